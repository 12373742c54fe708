"""Stage `traffic_replay`: how well the drafter fits a day of served prompts, and where it does not.

The first `limit` prompts of the day's sample (already redacted on the Dagster machine, in its seeded order) are
replayed as `speculate` replays the eval set: the target's greedy output, each verify step replayed on its hidden
states. Acceptance per prompt is then summed per group (data/prompt_groups.py: kind, length bucket, first words) the
way the engines count it (accepted tokens + 1 per verify step), and each group is set beside the share of the
drafter's training prompts in it: a group of traffic the drafter accepts badly and never trained on is where it went
stale. The prompts of lowest acceptance are listed with the similarity of their nearest training prompt (Jaccard of
character 5-grams, data/dedup.py's measure). With `eval_prompts`, the eval set is replayed too, with the same
settings, for the reference the traffic's figure is held against."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ..data.dedup import shingles
from ..data.prompt_groups import GROUP_BY, keys, user_text
from ..errors import StageError
from ..files import atomic_file, require_file, resolve
from .speculate import Pair, figures

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.traffic_replay import TrafficReplayArgs

PREVIEW_CHARS = 160


def _al(results: list[dict]) -> float | None:
    steps = sum(len(r["accepted"]) for r in results)
    return round(sum(a + 1 for r in results for a in r["accepted"]) / steps, 4) if steps else None


def groups(rows: list[dict], results: list[dict], eval_rows: list[dict], eval_results: list[dict],
           training: list[dict], min_group: int) -> list[dict]:
    """Per group of the traffic with at least `min_group` prompts, lowest acceptance first: its share of the traffic,
    acceptance length, the eval set's in the same group (when it has `min_group` there), and the share of the
    training prompts in it."""
    out = []
    for by in GROUP_BY:
        mine, theirs = defaultdict(list), defaultdict(list)
        for row, res in zip(rows, results):
            mine[row[by]].append(res)
        for row, res in zip(eval_rows, eval_results):
            theirs[row[by]].append(res)
        trained = defaultdict(int)
        for t in training:
            trained[t[by]] += 1
        for value, res in mine.items():
            if len(res) < min_group:
                continue
            out.append({"by": by, "value": value, "prompts": len(res), "share": round(len(res) / len(rows), 4),
                        "acceptance_length": _al(res),
                        "eval_acceptance_length": _al(theirs[value]) if len(theirs[value]) >= min_group else None,
                        "train_share": round(trained[value] / len(training), 4) if training else None})
    return sorted(out, key=lambda g: (g["acceptance_length"] or 0, -g["prompts"]))


def nearest_training(text: str, training: list[dict]) -> float | None:
    """The Jaccard similarity of the training prompt nearest to `text` (character 5-grams)."""
    if not training:
        return None
    grams = shingles(text)
    return round(max(len(grams & t["grams"]) / len(grams | t["grams"]) for t in training), 4)


def _training(workdir: str, paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        path = require_file(resolve(workdir, p), "the drafter's training prompts", "materialize conversations first")
        for r in pq.read_table(path, columns=["messages"]).to_pylist():
            text = user_text(r["messages"])
            out.append({**keys(r["messages"]), "grams": shingles(text)})
    return out


def run(workdir: str, args: TrafficReplayArgs, reporter) -> None:
    traffic = require_file(resolve(workdir, args.traffic), "the day's traffic sample",
                           "materialize that day's traffic partition first")
    rows = pq.read_table(traffic).to_pylist()[: args.limit]
    if not rows:
        raise StageError(f"{traffic} holds no prompts: that day's traffic partition is empty (no request of that "
                         "day was read); replay a day with traffic")
    rows = [{**r, **keys(r["messages"])} for r in rows]  # the same keys for a sample written before `kind` existed
    eval_rows = []
    if args.eval_prompts:
        path = require_file(resolve(workdir, args.eval_prompts), "eval prompts", "materialize prompts first")
        eval_rows = [{**r, **keys(r["messages"])} for r in pq.read_table(path).to_pylist()[: args.eval_limit]]
    training = _training(workdir, args.training)
    k = int(args.num_speculative_tokens)
    pair = Pair(workdir, args.target, args.drafter, args.device, args.dtype, k)
    t0 = time.monotonic()
    eval_results = list(pair.each(eval_rows, args.max_new_tokens, "replay", args.batch_size, reporter, "eval")) \
        if eval_rows else []
    results: list[dict] = []
    for i in range(0, len(rows), args.batch_size):  # a batch at a time, within the budget
        if args.budget_s and results and time.monotonic() - t0 > args.budget_s:
            reporter.log(f"the replay's budget ({args.budget_s:g} s) is spent: {len(results)} of {len(rows)} traffic "
                         "prompts replayed, the figures are theirs", "warning")
            break
        results += pair.each(rows[i: i + args.batch_size], args.max_new_tokens, "replay", args.batch_size, reporter,
                             "traffic")
    rows = rows[: len(results)]
    wall = time.monotonic() - t0

    per_prompt = []
    for row, res in zip(rows, results):
        text = user_text(row["messages"])
        per_prompt.append({"id": row["id"], "kind": row["kind"], "length_bucket": row["length_bucket"],
                           "first_words": row["first_words"], "user_chars": row["user_chars"],
                           "verify_steps": len(res["accepted"]), "accepted_tokens": sum(res["accepted"]),
                           "acceptance_length": _al([res]), "tokens": res["tokens"], "preview": text[:PREVIEW_CHARS]})
    worst = sorted((p for p in per_prompt if p["acceptance_length"] is not None),
                   key=lambda p: (p["acceptance_length"], p["id"]))[: args.lowest]
    for p, row in ((p, next(r for r in rows if r["id"] == p["id"])) for p in worst):
        p["nearest_training_similarity"] = nearest_training(user_text(row["messages"]), training)
    out = resolve(workdir, args.out)
    with atomic_file(out, fsync=True) as tmp:
        pq.write_table(pa.Table.from_pylist(per_prompt), tmp)

    fig = figures(results, k)
    grouped = groups(rows, results, eval_rows, eval_results, training, args.min_group)
    meta = {
        "path": str(out), "prompts": len(rows), **fig,
        "generated_tokens": sum(r["tokens"] for r in results),
        "num_speculative_tokens": k, "max_new_tokens": args.max_new_tokens, "dtype": pair.dtype,
        "groups": grouped,
        "lowest": [{k_: p.get(k_) for k_ in ("id", "kind", "length_bucket", "acceptance_length",
                                             "nearest_training_similarity", "preview")} for p in worst],
        "training_prompts": len(training), "drafter": str(pair.drafter_dir), "traffic": str(traffic),
        "wall_s": round(wall, 1), "niceness": os.nice(0),
    }
    if eval_rows:
        ev = figures(eval_results, k)
        meta.update(eval_acceptance_length=ev["acceptance_length"], eval_acceptance_per_pos=ev["acceptance_per_pos"],
                    eval_prompts=len(eval_rows))
    kinds = ", ".join(f"{g['value']} {g['acceptance_length']}" for g in grouped if g["by"] == "kind")
    reporter.log(f"traffic acceptance length {fig['acceptance_length']} on {len(rows)} prompts"
                 + (f" (eval {meta['eval_acceptance_length']})" if eval_rows else "") + f"; by kind: {kinds}")
    reporter.materialize(metadata=meta)
    reporter.result(meta)
