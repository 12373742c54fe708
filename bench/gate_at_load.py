"""The promotion gate's measurement at a load mix, through the `serve_compare` stage: a drafter and the target alone
served together in turn, on the recipe study's held-out test prompts, measured at each concurrency of the mix; the
speedup at the mix beside the speedup one request at a time (what the gate judged before it weighed the load). One
row per run in bench/results/gate_at_load.jsonl with the CPU and its load (this machine is shared).

    python bench/gate_at_load.py [--drafter DIR] [--mix 1=0.4 4=0.3 16=0.3] [--k 3] [--tokens 64] [--limit 16]

The drafter defaults to the shipped base drafter (exported for vLLM first)."""

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "gate_at_load"))
    ap.add_argument("--drafter", help="a drafter checkpoint (default: the shipped base drafter)")
    ap.add_argument("--mix", nargs="+", default=["1=0.4", "4=0.3", "16=0.3"],
                    help="concurrency=share of the output, as the serving eye observes it")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--limit", type=int, default=16, help="prompts per set")
    a = ap.parse_args()
    import pyarrow.parquet as pq

    from eagle3_assets.common import load_mix
    from eagle3_assets.worker.compute_dtype import cpu as cpu_info
    from eagle3_assets.worker.training.base_drafters import SHIPPED

    mix = load_mix.check({c: float(s) for c, s in (x.split("=", 1) for x in a.mix)})
    w = Path(a.workdir)
    _, res = stage(w, "prepare_target", {"path": None})
    (w / "prompts").mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts_table(splits()["test"]), w / "prompts" / "test.parquet")
    drafter = a.drafter or str(SHIPPED / "smollm2-135m-instruct")
    _, exp = stage(w, "export", {"drafter": drafter, "target": res["path"], "out": "exports/gate_at_load",
                                 "dialects": ["vllm"]})
    load = [round(x, 2) for x in os.getloadavg()]
    meta, out = stage(w, "serve_compare", {"target": res["path"], "drafters": {"drafter": exp["vllm_path"]},
                                           "prompt_sets": {"traffic": "prompts/test.parquet"}, "limit": a.limit,
                                           "load_mix": {str(c): s for c, s in mix.items()},
                                           "num_speculative_tokens": a.k, "max_new_tokens": a.tokens,
                                           "max_model_len": 2048, "extra_args": ["--enforce-eager"],
                                           "out_dir": "compare"})
    fig, base = meta["figures"]["drafter"]["traffic"], meta["figures"]["baseline"]["traffic"]
    info = cpu_info()
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "drafter": drafter, "cpu": info["cpu"], "cpu_isa": info["cpu_isa"],
           "emulated_isa": os.environ.get("ATEN_CPU_CAPABILITY"), "dtype": meta.get("dtype"), "k": a.k,
           "mix": {str(c): round(s, 4) for c, s in mix.items()}, "acceptance_length": fig["acceptance_length"],
           "tokens_per_s_by_concurrency": fig["tokens_per_s_by_concurrency"],
           "target_tokens_per_s_by_concurrency": base["tokens_per_s_by_concurrency"],
           "speedup_by_concurrency": fig["speedup_by_concurrency"],
           "speedup_one_at_a_time": fig["speedup_at_first_concurrency"], "speedup_at_mix": fig["speedup"],
           "stage_s": out["_wall_s"], "load_before": load, "load_after": [round(x, 2) for x in os.getloadavg()]}
    with (ROOT / "bench" / "results" / "gate_at_load.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
