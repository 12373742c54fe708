"""The scheduled server against the target alone and fixed k, in turn, at the schedule's edges and above: what
vLLM's dynamic speculation (`num_speculative_tokens_per_batch_size`) serves where a schedule turns speculation off.
Run after bench/load_curve.py (it serves that run's target and exported drafter); one row per run in
bench/results/schedule_edges.jsonl with the CPU.

    python bench/schedule_edges.py [--grid 8 16 32] [--tokens 64]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import load_curve_served  # noqa: E402

VARIANTS = {"target": None, "schedule_off": [[1, 2, 3], [3, 8, 2], [9, 1024, 0]],
            "schedule_k1": [[1, 2, 3], [3, 8, 2], [9, 1024, 1]], "fixed_k1": [[1, 1024, 1]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "load_curve"))
    ap.add_argument("--grid", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()

    from eagle3_assets.worker.compute_dtype import cpu as cpu_info
    from eagle3_assets.worker.engines import load, vllm
    from eagle3_assets.worker.engines.server import EngineServer, free_port
    from eagle3_assets.worker.serving.load_curve import _in_turn

    w = Path(a.workdir)
    target, drafter, prompts = load_curve_served(a.workdir)
    out, t0 = {}, time.monotonic()
    with ExitStack() as stack:
        servers, taken = {}, []
        for name, sched in VARIANTS.items():
            port = free_port(taken)
            taken.append(port)
            argv = vllm.server_command(sys.executable, str(target), port, drafter=str(drafter) if sched else None, k=3,
                                       dtype="bfloat16" if "avx512_bf16" in cpu_info()["cpu_isa"] else "float32",
                                       max_model_len=2048, seed=0, extra=["--enforce-eager"], schedule=sched)
            servers[name] = stack.enter_context(EngineServer(name, argv, port, w / f"edge-{name}.log",
                                                             env=vllm.SERVER_ENV, health=vllm.HEALTH))
        for srv in servers.values():
            srv.wait_ready(900)
            load.drive(srv.base_url, "target", prompts[:1], 4, 1)
        for c in a.grid:
            reqs = [load.Request(f"{p.id}#{i}", p.prompt_token_ids)
                    for i, p in ((i, prompts[i % len(prompts)]) for i in range(max(16, 2 * c)))]
            out[c] = {k: v["output_tokens_per_s"] for k, v in _in_turn(servers, reqs, c, a.tokens).items()}
            print(c, out[c], flush=True)
    info = cpu_info()
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": info["cpu"], "cpu_isa": info["cpu_isa"],
           "emulated_isa": os.environ.get("ATEN_CPU_CAPABILITY"), "variants": VARIANTS, "tok_s": out,
           "wall_s": round(time.monotonic() - t0, 1)}
    with (ROOT / "bench" / "results" / "schedule_edges.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
