"""How much old data a retraining on traffic should mix in (challenger_drafter's `mix_share`): the shipped base drafter
(trained on the shipped chat prompts) as the champion, traffic in languages it never saw (eagle3_assets/story/gateway.py) as the
new data, split as retrain_data splits it; the finetune run at each share, each measured offline (replay, k=3, 64
new tokens, float32) on the held-out traffic and on the old eval set (the recipe study's test prompts). The worker
stages are the product's own; nothing but the settings differs between the rows.

    python bench/retrain_mix.py --workdir /tmp/mix [--shares 0 0.25 0.5 0.75] [--epochs 3] [--device auto]

Writes bench/results/retrain_mix.json (one row per share, the champion first)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import FINETUNE, prompts_table, retrain_bench, splits, stage  # noqa: E402
from eagle3_assets.story.gateway import OTHER_LANGUAGES, other_language_prompts  # noqa: E402

BASE = "shipped:smollm2-135m-instruct"
REPLAY = {"max_new_tokens": 64, "num_speculative_tokens": 3, "dtype": "float32"}


def main() -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_assets.worker.training.base_drafters import init_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    ap.add_argument("--old", type=int, default=200, help="old (chat) training prompts regenerated")
    ap.add_argument("--eval", type=int, default=24, help="old eval prompts measured")
    args, w, target, t0 = retrain_bench(ap, "retrain_mix.json")
    parts = splits()
    pq.write_table(prompts_table(parts["train"][: args.old]), w / "p" / "old.parquet")
    pq.write_table(prompts_table(parts["test"][: args.eval]), w / "p" / "old_eval.parquet")
    texts = other_language_prompts(168) + OTHER_LANGUAGES
    pq.write_table(pa.Table.from_pylist([{"id": f"t{i}", "source": "traffic", "num_user_turns": 1,
                                          "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]),
                   w / "p" / "traffic.parquet")
    _, split = stage(w, "traffic_split", {"days": ["p/traffic.parquet"], "out_dir": "split"})
    gen = {"target": target, "max_new_tokens": 128, "backend": "hf", "batch_size": 32, "device": args.device}
    for name, prompts in (("new", split["train"]), ("old", "p/old.parquet")):
        if not (w / "shards" / name / "shard-00000" / "manifest.json").exists():
            _, g = stage(w, "generate", {**gen, "prompts": prompts, "out": f"conv/{name}.parquet"})
            stage(w, "extract", {"target": target, "conversations": f"conv/{name}.parquet", "out_dir": f"shards/{name}",
                                 "shard": 0, "samples_per_shard": g["conversations"], "device": args.device})
    rows = []

    def measure(label: str, drafter: str, extra: dict) -> None:
        figs = {}
        for where, prompts in (("traffic", split["heldout"]), ("old_eval", "p/old_eval.parquet")):
            off, _ = stage(w, "speculate", {"target": target, "drafter": drafter, "prompts": prompts, "limit": None,
                                            "device": args.device, **REPLAY})
            figs[where] = off["acceptance_length"]
        rows.append({"drafter": label, **extra, "heldout_traffic": figs["traffic"], "old_eval": figs["old_eval"]})
        print(json.dumps(rows[-1]), flush=True)

    measure("champion (the shipped base drafter)", str(init_dir(str(w), BASE)), {})
    for share in args.shares:
        run = f"mix{int(share * 100)}"
        meta, _ = stage(w, "train", {"target": target, "shards": ["shards/new/shard-00000"], "init_from": BASE,
                                     "mix_shards": ["shards/old/shard-00000"], "mix_share": share,
                                     "out": f"drafters/{run}", "epochs": args.epochs, "lr": args.lr, **FINETUNE,
                                     "device": args.device})
        measure(f"challenger, mix_share {share}", f"drafters/{run}/model",
                {"mix_share": share, "old_samples": meta.get("mix_old_samples", 0),
                 "new_samples": meta.get("mix_new_samples"), "steps": meta.get("steps"), "train_s": meta.get("wall_s")})
    out = {"date": time.strftime("%Y-%m-%d"), "traffic_prompts": len(texts), "train_prompts": split["train_prompts"],
           "heldout_prompts": split["heldout_prompts"], "old_prompts": args.old, "old_eval_prompts": args.eval,
           "epochs": args.epochs, "lr": args.lr, "replay": REPLAY, "rows": rows,
           "wall_s": round(time.monotonic() - t0, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
