"""What a step the schedule turns off costs, with the k=0 plugin (worker/engines/vllm/k0_plugin.py) and without:
the target alone, the scheduled server with vLLM's own k = 0 path ({"eagle3_k0": "off"}) and with the plugin, served
in paired rounds (each round every server serves one batch at the concurrency, the order rotating), each round's
ratio to the target alone's beside it. Per concurrency: the median ratio, its quartiles and the rounds. A fourth
server, timing only, leaves the drafter's KV unwritten at k = 0 (bench/k0_skip/sitecustomize.py): the cost of the
K/V-only pass is the gap between it and the plugin. One row per
run in bench/results/k0_off_switch.jsonl with the CPU. Run after bench/load_curve.py (or its set-up: the embedded
target and the shipped base drafter exported under bench/work/load_curve).

    python bench/k0_off_switch.py [--grid 16 32] [--rounds 8] [--tokens 64]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import load_curve_served  # noqa: E402

SCHEDULE = [[1, 2, 3], [3, 8, 2], [9, 1024, 0]]  # the schedule behind the 0.90x of bench/results/schedule_edges.jsonl
VARIANTS = {"target": None, "stock": {"eagle3_k0": "off"}, "plugin": {"eagle3_k0": "kv_only"},
            "plugin_no_sync": {"eagle3_k0": "kv_only"}}  # timing only: bench/k0_skip/sitecustomize.py


def spread(ratios: list[float]) -> dict:
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": round(statistics.median(ratios), 4), "q1": round(q[0], 4), "q3": round(q[2], 4),
            "min": round(min(ratios), 4), "max": round(max(ratios), 4), "rounds": len(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "load_curve"))
    ap.add_argument("--grid", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="auto: the product's choice for this CPU (bf16 where it has "
                    "AVX512-BF16, else float32)")
    a = ap.parse_args()

    from eagle3_assets.worker.compute_dtype import choice, host_device
    from eagle3_assets.worker.compute_dtype import cpu as cpu_info
    from eagle3_assets.worker.engines import load, vllm
    from eagle3_assets.worker.engines.server import EngineServer, free_port
    from eagle3_assets.worker.serving.bench import drive_in_turn

    w = Path(a.workdir)
    target, drafter, prompts = load_curve_served(a.workdir)
    dtype = choice(a.dtype, host_device())["dtype"]
    out, t0 = {}, time.monotonic()
    with ExitStack() as stack:
        servers, taken = {}, []
        for name, setting in VARIANTS.items():
            port = free_port(taken)
            taken.append(port)
            extra = ["--enforce-eager"] + (["--additional-config", json.dumps(setting)] if setting else [])
            argv = vllm.server_command(sys.executable, str(target), port, drafter=str(drafter) if setting else None,
                                       k=3, dtype=dtype, max_model_len=2048, seed=0, extra=extra, schedule=SCHEDULE)
            env = {**vllm.SERVER_ENV, **({"PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "k0_skip"), str(ROOT)])}
                                         if name == "plugin_no_sync" else {})}
            servers[name] = stack.enter_context(EngineServer(name, argv, port, w / f"k0-{name}.log", env=env,
                                                             health=vllm.HEALTH))
        for srv in servers.values():
            srv.wait_ready(900)
            load.drive(srv.base_url, "target", prompts[:1], 4, 1)
        for c in a.grid:
            reqs = [load.Request(f"{p.id}#{i}", p.prompt_token_ids)
                    for i, p in ((i, prompts[i % len(prompts)]) for i in range((a.rounds + 1) * c))]
            for srv in servers.values():  # a batch at this shape first, unmeasured: kernels built on first use
                load.drive(srv.base_url, "target", reqs[:c], 8, c)
            rates: dict = {}
            drive_in_turn(servers, [reqs[i * c: (i + 1) * c] for i in range(1, a.rounds + 1)], c, a.tokens,
                          lambda k, c=c: f"the {k} server at concurrency {c}", part_rates=rates)
            out[c] = {name: spread([r / b for r, b in zip(rates[name], rates["target"])])
                      for name in VARIANTS if name != "target"}
            out[c]["target_tok_s"] = round(statistics.median(rates["target"]), 2)
            print(c, json.dumps(out[c]), flush=True)
    info = cpu_info()
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": info["cpu"], "cpu_isa": info["cpu_isa"],
           "emulated_isa": os.environ.get("ATEN_CPU_CAPABILITY"), "dtype": dtype, "schedule": SCHEDULE,
           "tokens": a.tokens, "paired_ratios_to_target": out, "wall_s": round(time.monotonic() - t0, 1)}
    with (ROOT / "bench" / "results" / "k0_off_switch.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
