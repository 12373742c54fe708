"""Stage `traffic_split`: the newest traffic days (already sampled, redacted and free of near copies of the eval sets)
cut by a stable hash of each prompt into a training part, which a retraining regenerates and learns from, and a
held-out part, on which the promotion gate serves champion and challenger. A prompt that repeats across days falls
on the same side every time, so the gate never measures on a prompt the challenger trained on."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StageError
from ..files import atomic_file, require_file, resolve
from .dedup import normal
from .prompt_groups import user_text

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.traffic_split import TrafficSplitArgs

PROMPTS = ["id", "source", "messages", "num_user_turns"]  # the prompts asset's schema: generate and serve_bench read it


def held_out(messages: list[dict], share: float) -> bool:
    key = normal(user_text(messages)).encode()
    return int(hashlib.sha256(key).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def run(workdir: str, args: TrafficSplitArgs, reporter) -> None:
    train, heldout, seen, per_day = [], [], set(), {}
    for day in args.days:
        path = require_file(resolve(workdir, day), "a traffic day's sample", "materialize that traffic partition")
        rows = pq.read_table(path, columns=PROMPTS).to_pylist()
        per_day[path.stem] = len(rows)
        for r in rows:
            key = normal(user_text(r["messages"]))
            if key in seen:
                continue
            seen.add(key)
            (heldout if held_out(r["messages"], args.heldout_share) else train).append(r)
    if args.max_prompts:
        train = train[: args.max_prompts]
    if len(train) < args.min_prompts:
        why = (f"too little new traffic: {len(train)} training prompts in {len(args.days)} day(s) "
               f"({', '.join(f'{d}: {n}' for d, n in per_day.items())}), under min_prompts {args.min_prompts}: "
               "nothing is retrained. Wait for more traffic, take more days, or lower min_prompts")
        if args.short_ok:  # the caller waits and asks again: an answer, not a failure
            reporter.result({"short": True, "why": why, "train_prompts": len(train), "heldout_prompts": len(heldout),
                             "prompts_per_day": per_day})
            return
        raise StageError(why)
    if not heldout:
        raise StageError(f"no held-out prompt among {len(train)}: the gate would have nothing to measure on; raise "
                         "heldout_share or take more days")
    out = resolve(workdir, args.out_dir)
    paths = {}
    for name, rows in (("train", train), ("heldout", heldout)):
        paths[name] = out / f"{name}.parquet"
        with atomic_file(paths[name], fsync=True) as tmp:
            pq.write_table(pa.Table.from_pylist(rows), tmp)
    reporter.log(f"traffic split: {len(train)} prompts to train on, {len(heldout)} held out for the gate, from "
                 + ", ".join(f"{d} ({n})" for d, n in per_day.items()))
    meta = {"train": str(paths["train"]), "heldout": str(paths["heldout"]), "train_prompts": len(train),
            "heldout_prompts": len(heldout), "prompts_per_day": per_day, "heldout_share": args.heldout_share}
    reporter.materialize(metadata=meta)
    reporter.result(meta)
