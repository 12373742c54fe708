"""The load curve and speculation schedule of a drafter on the embedded target, through the `load_curve` stage:
vLLM servers for the target alone and each k, at a grid of concurrencies, on the recipe study's held-out test
prompts; one row per run in bench/results/load_curve.jsonl with the CPU and its load (this machine is shared).

    python bench/load_curve.py [--drafter DIR] [--grid 1 2 4 8 16 32] [--k 3] [--tokens 64]

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
from eagle3_assets.assets.speculation_schedule import best_fixed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "load_curve"))
    ap.add_argument("--drafter", help="a drafter checkpoint (default: the shipped base drafter)")
    ap.add_argument("--grid", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--k", type=int, default=3, help="the deepest k measured")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds per concurrency")
    ap.add_argument("--no-verify", action="store_true", help="skip serving the schedule beside the target alone "
                    "(serve_bench at every concurrency of the grid, as serving_benchmark verifies it)")
    a = ap.parse_args()
    import pyarrow.parquet as pq

    from eagle3_assets.worker.compute_dtype import cpu as cpu_info
    from eagle3_assets.worker.training.base_drafters import SHIPPED

    w = Path(a.workdir)
    _, res = stage(w, "prepare_target", {"path": None})
    (w / "prompts").mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts_table(splits()["test"]), w / "prompts" / "test.parquet")
    drafter = a.drafter or str(SHIPPED / "smollm2-135m-instruct")
    _, exp = stage(w, "export", {"drafter": drafter, "target": res["path"], "out": "exports/load_curve",
                                 "dialects": ["vllm"]})
    load = [round(x, 2) for x in os.getloadavg()]
    meta, out = stage(w, "load_curve", {"target": res["path"], "drafter": exp["vllm_path"],
                                        "prompts": "prompts/test.parquet", "out_dir": "load_curve",
                                        "concurrencies": a.grid, "num_speculative_tokens": a.k,
                                        "max_new_tokens": a.tokens, "rounds": a.rounds,
                                        "max_model_len": 2048, "extra_args": ["--enforce-eager"]})
    info = cpu_info()
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "drafter": drafter, "cpu": info["cpu"], "cpu_isa": info["cpu_isa"],
           "emulated_isa": os.environ.get("ATEN_CPU_CAPABILITY"), "dtype": meta.get("dtype"),
           "grid": meta["grid"], "schedule": meta["schedule"], "schedule_text": meta["schedule_text"],
           "table": meta["table"], "sweep_s": meta["wall_s"], "stage_s": out["_wall_s"],
           "load_before": load, "load_after": [round(x, 2) for x in os.getloadavg()]}
    if not a.no_verify:  # as serving_benchmark verifies it: paired rounds at every concurrency, the sweep's choice
        table = [{"concurrency": r["concurrency"], "k": r["k"], "speedup": r["speedup"]} for r in meta["table"]]
        vmeta, vres = stage(w, "serve_bench", {"target": res["path"], "drafter": exp["vllm_path"],
                                               "prompts": "prompts/test.parquet", "limit": None,
                                               "max_new_tokens": a.tokens, "concurrencies": meta["grid"],
                                               "schedule": meta["schedule"], "baseline": True, "max_model_len": 2048,
                                               "rounds": a.rounds, "extra_args": ["--enforce-eager"],
                                               "out_dir": "verify", "history": "verify/history.parquet",
                                               "prompt_set": "test", "verify": {"table": table, "max_batch":
                                                                                meta["max_batch"], "tolerance": 0.03}})
        fixed = {r["concurrency"]: best_fixed(r, meta["ks"]) for r in meta["table"]}
        row["verify"] = [{"concurrency": c, "scheduled_tok_s": vmeta.get(f"output_tokens_per_s_c{c}"),
                          "target_tok_s": vmeta.get(f"baseline_output_tokens_per_s_c{c}"),
                          "scheduled_speedup": vmeta.get(f"speedup_c{c}"),
                          "q1": vmeta.get(f"speedup_q1_c{c}"), "q3": vmeta.get(f"speedup_q3_c{c}"),
                          "best_fixed_k_speedup": round(fixed[c], 3),
                          "vs_better": round(vmeta[f"speedup_c{c}"] / max(1.0, fixed[c]), 3)
                          if vmeta.get(f"speedup_c{c}") else None} for c in meta["grid"]]
        row.update(verification=vmeta.get("verification"), fell_back_at=vmeta.get("fell_back_at"),
                   served_schedule_text=vmeta.get("verified_schedule_text") or meta["schedule_text"],
                   k0_plugin=vmeta.get("k0_plugin"), verify_s=vres["_wall_s"],
                   acceptance_length_c1=vmeta.get("acceptance_length_c1"))
    with (ROOT / "bench" / "results" / "load_curve.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
