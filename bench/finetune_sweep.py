"""The main command's finetune of the shipped base drafter (issue 39): which learning rate and how many epochs.

The main command's own training data (its hidden_state_shards, from `eagle3-assets materialize` in --home), the
shipped base drafter as the start, the preset's other settings; only lr and epochs change between rows. Each row
is measured teacher-forced (k=3, replies only) on the recipe study's dev prompts, regenerated and extracted once
(never the 54 test prompts the goal is judged on), after every epoch, and the base drafter unchanged first.

    python bench/finetune_sweep.py --home $DAGSTER_HOME --workdir /tmp/ft [--lrs 3e-5 1e-4 3e-4] [--epochs 3]

Writes bench/results/finetune_sweep.json (a rerun on the same --home adds the rows it lacks); the CPU and its ISA
in each row (training is bf16 autocast on a CPU with bf16 instructions, float32 without).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import prompts_table, splits, stage  # noqa: E402

BASE = "shipped:smollm2-135m-instruct"


def main() -> int:
    import pyarrow.parquet as pq

    from eagle3_assets.worker.compute_dtype import cpu as cpu_info
    from eagle3_assets.worker.training.base_drafters import init_dir
    from eagle3_assets.worker.training.evaluate import heldout_acceptance

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True, help="DAGSTER_HOME of a main command (its host-work holds the shards)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4])
    ap.add_argument("--epochs", type=int, nargs="+", default=[3])
    ap.add_argument("--dev", type=int, default=74, help="dev prompts (all 74 by default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "finetune_sweep.json"))
    a = ap.parse_args()
    w, host = Path(a.workdir).resolve(), Path(a.home).resolve() / "host-work"
    w.mkdir(parents=True, exist_ok=True)
    target = str(next((host / "target").iterdir()))
    shards = sorted(str(p.parent) for p in (host / "hidden_states").glob("**/manifest.json"))
    if not shards:
        raise SystemExit(f"no hidden-state shards under {host}/hidden_states: run the main command there first")
    preset = yaml.safe_load((ROOT / "eagle3_assets" / "presets" / "embedded_cpu.yaml").read_text())
    hp = {k: v for k, v in preset["ops"]["eagle3_drafter"]["config"].items() if k not in ("time_budget_s",)}
    t0 = time.monotonic()
    (w / "p").mkdir(exist_ok=True)
    pq.write_table(prompts_table(splits()["dev"][: a.dev]), w / "p" / "dev.parquet")
    if not (w / "dev" / "shard-00000" / "manifest.json").exists():
        _, g = stage(w, "generate", {"target": target, "prompts": "p/dev.parquet", "out": "conv/dev.parquet",
                                     "max_new_tokens": 128, "temperature": 0.0, "backend": "hf", "batch_size": 32})
        stage(w, "extract", {"target": target, "conversations": "conv/dev.parquet", "out_dir": "dev", "shard": 0,
                             "samples_per_shard": g["conversations"]})
    dev = [str(w / "dev" / "shard-00000")]
    info = cpu_info()
    out_path = Path(a.out)
    earlier = json.loads(out_path.read_text()) if out_path.exists() else {}
    rows = earlier.get("rows", []) if earlier.get("home") == str(a.home) else []  # a rerun adds rows
    if not rows:
        base = heldout_acceptance(Path(target), init_dir(str(w), BASE), [Path(d) for d in dev])
        rows = [{"drafter": "base (not finetuned)", "dev_acceptance_length": round(base["acceptance_length"], 4)}]
        print(json.dumps(rows[-1]), flush=True)
    for epochs in a.epochs:
        for lr in a.lrs:
            run = f"lr{lr:g}_e{epochs}"
            if any(r["drafter"] == run for r in rows):
                continue
            meta, res = stage(w, "train", {**hp, "target": target, "shards": shards, "eval_shards": dev,
                                           "vocab": str(host / "vocab" / "vocab_mapping.safetensors"),
                                           "init_from": BASE, "out": f"drafters/{run}", "epochs": epochs, "lr": lr})
            rows.append({"drafter": run, "lr": lr, "epochs": epochs, "steps": meta.get("steps"),
                         "train_s": meta.get("wall_s"), "compute": meta.get("compute"),
                         "dev_acceptance_length": meta.get("heldout_acceptance_length_k3"),
                         "dev_per_epoch": (meta.get("heldout_curve") or {}).get("acceptance_length")})
            print(json.dumps(rows[-1]), flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "home": str(a.home), "train_shards": shards, "dev_prompts": a.dev,
           "fixed": hp, "cpu": info["cpu"], "cpu_isa": info["cpu_isa"], "rows": rows,
           "wall_s": round(time.monotonic() - t0, 1)}
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
