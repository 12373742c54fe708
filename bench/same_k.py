"""The engine's acceptance against our offline replay at the same k (issue 58): what `acceptance_matches_offline`'s
floor (`min_ratio_to_offline`) rests on. One drafter (default: the shipped base drafter of the embedded SmolLM2),
offline_acceptance's replay once at k = 3 in float32 (it measures every k from 1 to 3 in one pass), then vLLM's CPU
build serving it at k = 1, 2, 3, and at k = 2 through a speculation schedule ([1, 1, 2], [2, 64, 3] at one request:
the user's case), greedy, concurrency 1, --enforce-eager, in the dtype each run names (auto: bf16 on a CPU with bf16
instructions).

    python bench/same_k.py --workdir /tmp/same_k --split test                       # 54 held-out prompts, bf16 and float32
    python bench/same_k.py --workdir /tmp/same_k8 --split dev --limit 8 --runs auto:1 auto:2 auto:3

One row per measurement in bench/results/same_k.jsonl (the offline figures first), with the CPU and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import prompts_table, splits, stage  # noqa: E402

SCHEDULE = [[1, 1, 2], [2, 64, 3]]
RUNS = ["auto:1", "auto:2", "auto:3", "auto:sched", "float32:1", "float32:2", "float32:3"]


def main() -> None:
    import pyarrow.parquet as pq

    from eagle3_assets.worker.compute_dtype import cpu as cpu_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--split", default="test", choices=["dev", "test"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default=str(ROOT / "eagle3_assets" / "base_drafters" / "smollm2-135m-instruct"))
    ap.add_argument("--runs", nargs="+", default=RUNS, help="dtype:k (k `sched`: k 2 through SCHEDULE)")
    a = ap.parse_args()
    w = Path(a.workdir).resolve()
    w.mkdir(parents=True, exist_ok=True)
    info = cpu_info()
    common_row = {"split": a.split, "limit": a.limit, "max_new_tokens": a.max_new_tokens, "drafter": a.drafter,
                  "cpu": info["cpu"], "cpu_isa": info["cpu_isa"]}

    def log(row: dict) -> None:
        row = {**common_row, **row, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), "load": round(os.getloadavg()[0], 2)}
        print(json.dumps(row), flush=True)
        with (ROOT / "bench" / "results" / "same_k.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    _, res = stage(w, "prepare_target", {"path": None})
    (w / "prompts").mkdir(exist_ok=True)
    pq.write_table(prompts_table(splits()[a.split]), w / "prompts" / f"{a.split}.parquet")
    _, exp = stage(w, "export", {"drafter": a.drafter, "target": res["path"], "out": "exports/d", "dialects": ["vllm"]})
    common = {"target": res["path"], "prompts": f"prompts/{a.split}.parquet", "limit": a.limit,
              "max_new_tokens": a.max_new_tokens}
    off, r = stage(w, "speculate", {**common, "drafter": a.drafter, "dtype": "float32", "num_speculative_tokens": 3})
    log({"what": "offline", **{k: v for k, v in off.items() if k.startswith("accept")}, "wall_s": r["_wall_s"]})
    for run in a.runs:
        dtype, k = run.split(":")
        sched = SCHEDULE if k == "sched" else None
        k = max(x[2] for x in SCHEDULE) if sched else int(k)
        args = {**common, "engine": "vllm", "drafter": exp["vllm_path"], "num_speculative_tokens": k,
                "concurrencies": [1], "baseline": False, "dtype": dtype, "max_model_len": 2048, "prompt_set": a.split,
                "checkpoint": "same_k", "out_dir": f"serving/{run.replace(':', '-')}", "history": "serving/h.parquet",
                "extra_args": ["--enforce-eager"], **({"schedule": sched} if sched else {})}
        meta, r = stage(w, "serve_bench", args)
        ak = meta["acceptance_k"]
        log({"what": "vllm", "dtype": meta.get("dtype"), "k": k, "schedule": sched, "acceptance_k": ak,
             "acceptance_length": meta["acceptance_length"], "per_pos": meta["acceptance_per_pos"],
             "offline_same_k": off[f"acceptance_length_k{ak}"],
             "ratio": round(meta["acceptance_length"] / off[f"acceptance_length_k{ak}"], 4), "wall_s": r["_wall_s"]})


if __name__ == "__main__":
    main()
