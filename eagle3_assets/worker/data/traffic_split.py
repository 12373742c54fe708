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
from .prompt_groups import GROUP_BY, group_value, keys, served_groups, user_text

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.traffic_split import TrafficSplitArgs

PROMPTS = ["id", "source", "messages", "num_user_turns"]  # the prompts asset's schema: generate and serve_bench read it
SERVED = ["timestamp", "served_steps", "served_accepted", "gateway_fields", *GROUP_BY]  # read where a day has them (older: not)


def held_out(messages: list[dict], share: float) -> bool:
    key = normal(user_text(messages)).encode()
    return int(hashlib.sha256(key).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def boosts(rows: list[dict], by: str, max_boost: float, min_group: int) -> tuple[dict, list[dict]]:
    """Each slice's boost from its served acceptance: the best slice's drafts accepted per verify step over this
    slice's (a slice gaining half as much per step gets twice the weight), at most max_boost; with the figures."""
    groups = served_groups(rows, [by], min_group)["groups"]
    top = max((g["acceptance_length"] for g in groups), default=1.0) - 1
    out = {}
    for g in groups:
        gain = g["acceptance_length"] - 1
        out[g["value"]] = 1.0 if top <= 0 else round(min(max_boost, top / gain if gain > 0 else max_boost), 3)
    return out, groups


def weighted(train: list[dict], n: int, by: str, boost: dict) -> tuple[list[dict], dict]:
    """n training prompts shared out by slice (requests x boost, largest remainders), each slice's in the day's order,
    repeating its prompts (under a new id) when its share outgrows them; and how many each slice got."""
    slices: dict = {}
    for i, r in enumerate(train):
        slices.setdefault(group_value(r, by), []).append(i)
    mass = {v: len(ix) * boost.get(v, 1.0) for v, ix in slices.items()}
    quota = {v: n * m / sum(mass.values()) for v, m in mass.items()}
    take = {v: int(q) for v, q in quota.items()}
    for v in sorted(quota, key=lambda v: take[v] - quota[v])[: n - sum(take.values())]:
        take[v] += 1
    first = sorted(i for v, ix in slices.items() for i in ix[: take[v]])
    again = [{**train[ix[j % len(ix)]], "id": f"{train[ix[j % len(ix)]]['id']}~{j // len(ix)}"}
             for v, ix in slices.items() for j in range(len(ix), take[v])]
    return [train[i] for i in first] + again, take


def run(workdir: str, args: TrafficSplitArgs, reporter) -> None:
    train, heldout, seen, per_day = [], [], set(), {}
    for day in args.days:
        path = require_file(resolve(workdir, day), "a traffic day's sample", "materialize that traffic partition")
        have = set(pq.read_schema(path).names)
        rows = pq.read_table(path, columns=PROMPTS + [c for c in SERVED if c in have]).to_pylist()
        per_day[path.stem] = len(rows)
        for r in rows:
            key = normal(user_text(r["messages"]))
            if key in seen:
                continue
            seen.add(key)
            (heldout if held_out(r["messages"], args.heldout_share) else train).append(r)
    n = min(len(train), args.max_prompts or len(train))
    weighting = None
    if args.weight_by:
        for r in train + heldout:  # a day written before the keys were kept: read them off the text
            if args.weight_by in GROUP_BY and r.get(args.weight_by) is None:
                r.update(keys(r["messages"]))
        # figures the drafter being retrained served: a request logged before its promotion was another's
        since = [r for r in train + heldout if args.served_since is None or (r.get("timestamp") or 0) >= args.served_since]
        boost, groups = boosts(since, args.weight_by, args.max_boost, args.min_group)
        weighting = {"by": args.weight_by, "applied": any(b > 1 for b in boost.values())}
        if weighting["applied"]:
            train, take = weighted(train, n, args.weight_by, boost)
            weighting["slices"] = [{"value": g["value"], "requests": g["requests"],
                                    "acceptance_length": g["acceptance_length"], "boost": boost[g["value"]],
                                    "train_rows": take.get(g["value"], 0)} for g in groups]
        else:
            weighting["why"] = (f"no slice of {args.weight_by} has {args.min_group} requests with served figures"
                                + (" since the drafter's promotion" if args.served_since else "") +
                                " (the gateway log needs vLLM's per-request metrics)" if not groups else
                                "every slice served alike") + ": uniform"
            train = train[:n]
        reporter.log(f"weighted by {args.weight_by}: " + (", ".join(
            f"{s['value']} (served {s['acceptance_length']}, boost {s['boost']}: {s['train_rows']} rows)"
            for s in weighting["slices"]) if weighting["applied"] else weighting["why"]))
    else:
        train = train[:n]
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
            pq.write_table(pa.Table.from_pylist([{c: r[c] for c in PROMPTS} for r in rows]), tmp)
    reporter.log(f"traffic split: {len(train)} prompts to train on, {len(heldout)} held out for the gate, from "
                 + ", ".join(f"{d} ({n})" for d, n in per_day.items()))
    meta = {"train": str(paths["train"]), "heldout": str(paths["heldout"]), "train_prompts": len(train),
            "heldout_prompts": len(heldout), "prompts_per_day": per_day, "heldout_share": args.heldout_share,
            **({"weighting": weighting} if weighting else {})}
    reporter.materialize(metadata=meta)
    reporter.result(meta)
