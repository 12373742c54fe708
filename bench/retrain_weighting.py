"""Should a retraining weight the slices production served worst (retrain_data's `weight_by`)? A day of mixed traffic:
English chat the shipped base drafter never trained on (the recipe study's dev and test prompts) and prompts in
languages it never saw (eagle3_assets/story/gateway.py). Each request carries served figures, as a gateway log with
vLLM's per-request metrics would: here the champion's offline acceptance on its kind (replay, k=3, 64 new tokens,
float32; no vLLM in this bench), so the kinds serve as production would see them. The day is split as retrain_data
splits it, once uniform and once weighted by kind, with the same budget of training prompts; each set is regenerated,
extracted and finetuned from the champion the same way; each drafter is measured offline on the held-out traffic,
on each kind's held-out part and on all of it. The worker stages are the product's own.

    python bench/retrain_weighting.py --workdir /tmp/weighting [--epochs 3] [--seeds 0 1] [--device auto]

Writes bench/results/retrain_weighting.json."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import FINETUNE, retrain_bench, splits, stage  # noqa: E402
from eagle3_assets.story.gateway import OTHER_LANGUAGES, other_language_prompts  # noqa: E402

BASE = "shipped:smollm2-135m-instruct"
REPLAY = {"max_new_tokens": 64, "num_speculative_tokens": 3, "dtype": "float32", "limit": None}
KINDS = ("chat", "other-language")


def rows_of(texts: list[str], kind: str) -> list[dict]:
    return [{"id": f"{kind}-{i}", "source": "traffic", "num_user_turns": 1, "kind": kind,
             "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]


def main() -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_assets.worker.compute_dtype import cpu
    from eagle3_assets.worker.training.base_drafters import init_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--other", type=int, default=64, help="prompts in other languages in the day")
    ap.add_argument("--heldout-share", type=float, default=0.3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--max-boost", type=float, default=3.0)
    args, w, target, t0 = retrain_bench(ap, "retrain_weighting.json")
    parts = splits()
    chat = [c.messages[-1]["content"] for c in parts["dev"] + parts["test"] if len(c.messages) == 1]
    day = {"chat": rows_of(chat, "chat"),
           "other-language": rows_of((other_language_prompts(168) + OTHER_LANGUAGES)[: args.other], "other-language")}
    champion = str(init_dir(str(w), BASE))

    def offline(drafter: str, prompts: str) -> float:
        off, _ = stage(w, "speculate", {"target": target, "drafter": drafter, "prompts": prompts,
                                        "device": args.device, **REPLAY})
        return off["acceptance_length"]

    # served figures: the champion's acceptance on each kind, as 64-token requests (steps, drafts accepted)
    served = {}
    for kind, rows in day.items():
        pq.write_table(pa.Table.from_pylist(rows), w / "p" / f"served-{kind}.parquet")
        served[kind] = offline(champion, f"p/served-{kind}.parquet")
    steps = {k: round(REPLAY["max_new_tokens"] / al) for k, al in served.items()}
    pq.write_table(pa.Table.from_pylist([
        {**r, "served_steps": steps[k], "served_accepted": round(steps[k] * (served[k] - 1))}
        for k, rows in day.items() for r in rows]), w / "p" / "day.parquet")
    split = {"days": ["p/day.parquet"], "heldout_share": args.heldout_share, "min_group": 8}
    sets = {"uniform": {"weight_by": None}, "weighted by kind": {"weight_by": "kind", "max_boost": args.max_boost}}
    made = {}
    for i, (label, extra) in enumerate(sets.items()):
        _, made[label] = stage(w, "traffic_split", {**split, **extra, "out_dir": f"split{i}"})
        if not (w / f"shards{i}" / "shard-00000" / "manifest.json").exists():
            _, g = stage(w, "generate", {"target": target, "prompts": made[label]["train"], "max_new_tokens": 128,
                                         "backend": "hf", "batch_size": 32, "device": args.device,
                                         "out": f"conv{i}.parquet"})
            stage(w, "extract", {"target": target, "conversations": f"conv{i}.parquet", "out_dir": f"shards{i}",
                                 "shard": 0, "samples_per_shard": g["conversations"], "device": args.device})
    # the held-out part is the same for both (a hash of each prompt): measured per kind and whole
    held = pq.read_table(w / "split0" / "heldout.parquet").to_pylist()
    ids = {r["id"] for r in held}
    for kind in KINDS:
        pq.write_table(pa.Table.from_pylist([{c: r[c] for c in ("id", "source", "messages", "num_user_turns")}
                                             for r in held if r["id"].startswith(kind)]), w / "p" / f"held-{kind}.parquet")
    train_ids = {label: [r["id"] for r in pq.read_table(made[label]["train"]).to_pylist()] for label in sets}
    assert not ids & {i.split("~")[0] for v in train_ids.values() for i in v}

    def measure(drafter: str) -> dict:
        out = {f"heldout_{k}": offline(drafter, f"p/held-{k}.parquet") for k in KINDS}
        out["heldout_all"] = offline(drafter, made["uniform"]["heldout"])
        return out

    rows = [{"drafter": "champion (the shipped base drafter)", **measure(champion)}]
    print(json.dumps(rows[-1]), flush=True)
    for seed in args.seeds:
        for i, label in enumerate(sets):
            run = f"w{i}s{seed}"
            meta, _ = stage(w, "train", {"target": target, "shards": [f"shards{i}/shard-00000"], "init_from": BASE,
                                         "out": f"drafters/{run}", "epochs": args.epochs, "lr": args.lr,
                                         **FINETUNE, "seed": seed, "device": args.device})
            rows.append({"drafter": f"challenger, {label}", "seed": seed, "steps": meta.get("steps"),
                         "train_s": meta.get("wall_s"), **measure(f"drafters/{run}/model")})
            print(json.dumps(rows[-1]), flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu(), "served_by_kind": served,
           "day": {k: len(v) for k, v in day.items()},
           "heldout": {k: sum(r["id"].startswith(k) for r in held) for k in KINDS},
           "train": {label: {k: sum(i.startswith(k) for i in v) for k in KINDS} for label, v in train_ids.items()},
           "weighting": made["weighted by kind"].get("weighting"), "epochs": args.epochs, "lr": args.lr,
           "replay": REPLAY, "rows": rows, "wall_s": round(time.monotonic() - t0, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
