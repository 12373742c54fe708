"""How many tokens to draft on a CPU (issue 39): the cost of a draft and of a verify step, measured in vLLM.

One drafter (the main command's finetune, say) served by vLLM's CPU build at k = 1..5 on the recipe study's dev
prompts (never the 54 test prompts the goal is judged on), greedy, concurrency 1, the main command's launch flags
(--enforce-eager, the stage's dtype choice: bf16 on a CPU with bf16 instructions, float32 without), and the target
alone before and after the sweep. From each k's tokens/s and acceptance length AL(k):

    step(k) = AL(k) / tokens_per_s(k)         the wall time of one speculative step (k drafts + one verify)
    plain   = 1 / baseline_tokens_per_s       the wall time of one plain decode step
    step(k) ~ verify + k * draft              least squares over k: what a verify step and a draft cost

in units of a plain step; the k with the highest measured speedup is the one the main command should serve with.

    python bench/spec_k_cpu.py --drafter $DAGSTER_HOME/host-work/drafter/default/model [--ks 1 2 3 4 5] [--limit 24]
    EAGLE3_CPU_BF16=0 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/spec_k_cpu.py ...  # AVX2 only

One row per run in bench/results/spec_k_cpu.jsonl, with the CPU, its ISA, the dtype and the load.
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


def fit(ks: list[int], steps: list[float]) -> tuple[float, float]:
    """Least-squares line step = verify + k * draft."""
    n, mk, ms = len(ks), sum(ks) / len(ks), sum(steps) / len(steps)
    var = sum((k - mk) ** 2 for k in ks)
    if n < 2 or var == 0:
        raise ValueError("the fit needs two or more different k")
    draft = sum((k - mk) * (s - ms) for k, s in zip(ks, steps)) / var
    return ms - draft * mk, draft


def sweep(w: Path, drafter: Path, ks: list[int], limit: int, max_new: int, split: str) -> dict:
    import pyarrow.parquet as pq

    from eagle3_assets.worker.compute_dtype import cpu as cpu_info

    _, res = stage(w, "prepare_target", {"path": None})
    target = res["path"]
    (w / "prompts").mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts_table(splits()[split]), w / "prompts" / f"{split}.parquet")
    _, exp = stage(w, "export", {"drafter": str(drafter), "target": target, "out": "exports/sweep",
                                 "dialects": ["vllm"]})
    load = [round(x, 2) for x in os.getloadavg()]
    per_k, baselines, dtype = [], [], None
    for i, k in enumerate(ks):
        with_baseline = i in (0, len(ks) - 1)  # the target alone before and after: the host's drift shows
        meta, res = stage(w, "serve_bench", {
            "engine": "vllm", "target": target, "drafter": exp["vllm_path"], "prompts": f"prompts/{split}.parquet",
            "limit": limit, "max_new_tokens": max_new, "num_speculative_tokens": k, "concurrencies": [1],
            "baseline": with_baseline, "dtype": "auto", "max_model_len": 2048, "prompt_set": split,
            "checkpoint": f"k{k}", "out_dir": f"serving/k{k}", "history": "serving/history.parquet",
            "start_servers": "one_at_a_time", "extra_args": ["--enforce-eager"]})
        dtype = meta.get("dtype")
        if with_baseline:
            baselines.append(meta["baseline_output_tokens_per_s_c1"])
        per_k.append({"k": k, "acceptance_length": meta["acceptance_length"],
                      "acceptance_per_pos": meta["acceptance_per_pos"],
                      "tokens_per_s": meta["output_tokens_per_s_c1"], "wall_s": res["_wall_s"]})
        print(f"== k={k}: AL {meta['acceptance_length']:.3f}, {meta['output_tokens_per_s_c1']:.2f} tokens/s "
              f"({res['_wall_s']:.0f} s)", flush=True)
    base = sum(baselines) / len(baselines)
    plain = 1.0 / base
    for r in per_k:
        r["step_in_plain_steps"] = round(r["acceptance_length"] / r["tokens_per_s"] / plain, 3)
        r["speedup"] = round(r["tokens_per_s"] / base, 3)
    verify, draft = fit([r["k"] for r in per_k], [r["step_in_plain_steps"] for r in per_k])
    best = max(per_k, key=lambda r: r["speedup"])
    info = cpu_info()
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "drafter": str(drafter), "prompt_set": split,
           "prompts": limit, "max_new_tokens": max_new, "dtype": dtype, "cpu": info["cpu"],
           "cpu_isa": info["cpu_isa"], "emulated_isa": os.environ.get("ATEN_CPU_CAPABILITY"),
           "baseline_tokens_per_s": [round(b, 2) for b in baselines], "per_k": per_k,
           "verify_in_plain_steps": round(verify, 3), "draft_in_plain_steps": round(draft, 3),
           "best_k": best["k"], "load_before": load, "load_after": [round(x, 2) for x in os.getloadavg()]}
    with (ROOT / "bench" / "results" / "spec_k_cpu.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a trained drafter directory (drafter/<run>/model)")
    ap.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "spec_k"))
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--limit", type=int, default=24, help="dev prompts sent per k")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--split", choices=["dev", "test"], default="dev", help="dev: choose on it; test: report")
    a = ap.parse_args()
    w = Path(a.workdir).resolve()
    w.mkdir(parents=True, exist_ok=True)
    sweep(w, Path(a.drafter).resolve(), a.ks, a.limit, a.max_new_tokens, a.split)


if __name__ == "__main__":
    main()
