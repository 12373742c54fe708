"""vLLM's CPU build on a small host: how its servers are started, against vLLM's own defaults.

    python bench/vllm_cpu_servers.py --instance $DAGSTER_HOME      # after `eagle3-assets materialize`

Two ways, each in a fresh set of processes, with the main command's target, exported drafter and held-out
prompts (taken from the instance's host work directory):
- `default`: vLLM's CPU build as it comes (the multiprocessing executor: the API server, an engine core and a
  worker process, each importing torch and vLLM), the EAGLE-3 server then the baseline server, one after the
  other, as a GPU host runs them;
- `shipped`: what the serving benchmark and regeneration do on a host without GPUs (engines/vllm SERVER_ENV
  and server_command: the model in the engine core's process on every core) with both servers started
  together (serving/bench.start_together), measured one at a time.
Both keep the rest of our CPU settings (VLLM_CPU_KVCACHE_SPACE, no reserved core on at most 4 CPUs,
--enforce-eager as the preset). Timed: each server's ready time from its start, the time to both ready
(one after the other: the sum of the two starts), then the serving benchmark's measurement (8 prompts x 64
tokens at c=1, greedy, after one warm-up request: tokens/s and vLLM's acceptance length), and 64 training
prompts x 128 tokens at once (regeneration's batch). Prints one JSON line per way; --out writes them."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu() -> str:
    from eagle3_assets.worker.compute_dtype import cpu

    info = cpu()
    return f"{info['cpu']} ({', '.join(info['cpu_isa']) or 'no AVX'})"


def run(way: str, work: Path, k: int) -> dict:
    import pyarrow.parquet as pq

    from eagle3_assets.worker.engines import load
    from eagle3_assets.worker.engines import vllm as engine
    from eagle3_assets.worker.engines.server import EngineServer, free_port
    from eagle3_assets.worker.report import Reporter
    from eagle3_assets.worker.serving.bench import measure
    from eagle3_assets.worker.target.chat import first_turn_prompt
    from eagle3_assets.worker.target.model import load_tokenizer

    target = next((work / "target").glob("*/config.json")).parent
    drafter = next((work / "exports").glob("*/vllm/config.json")).parent
    tok = load_tokenizer(target)

    def requests(name: str, n: int):
        rows = pq.read_table(work / "prompts" / name).to_pylist()[:n]
        return [load.Request(r["id"], first_turn_prompt(tok, r["messages"])) for r in rows]

    held_out, batch = requests("eval.parquet", 8), requests("train.parquet", 64)
    shipped = way == "shipped"
    env = dict(engine.SERVER_ENV if shipped else engine.EXTRACT_ENV)  # EXTRACT_ENV: vLLM's own processes
    engine.ONE_PROCESS = shipped  # server_command adds the uni executor only then
    out_dir = work / "bench-vllm-cpu-servers" / way
    out = {"way": way, "cpu": _cpu(), "env": env}

    def server(mode: str, taken: list[int]) -> EngineServer:
        argv = engine.server_command(sys.executable, str(target), free_port(taken), k=k, dtype="float32",
                                     drafter=str(drafter) if mode == "eagle3" else None, max_model_len=2048,
                                     seed=0, extra=["--enforce-eager"])
        return EngineServer(f"vllm ({mode})", argv, int(argv[argv.index("--port") + 1]),
                            out_dir / f"server-{mode}.log", env=env, health=engine.HEALTH)

    def bench(srv: EngineServer, mode: str) -> None:
        load.drive(srv.base_url, "target", held_out[:1], 4, 1)
        figures, _ = measure(engine, srv, held_out, 1, 64, k, Reporter(), mode == "eagle3")
        out[f"{mode}_tokens_per_s_c1"] = figures["output_tokens_per_s"]
        if mode == "eagle3":
            out["acceptance_length"] = figures["acceptance_length"]
        else:
            responses, wall = load.drive(srv.base_url, "target", batch, 128, 64)
            out["batch64_tokens_per_s"] = load.summarize(responses, wall)["output_tokens_per_s"]

    t0 = time.monotonic()
    with ExitStack() as stack:
        if shipped:
            servers = []
            for mode in ("eagle3", "baseline"):
                servers.append((stack.enter_context(server(mode, [s.port for s, _ in servers])), mode))
            for srv, mode in servers:
                out[f"{mode}_ready_s"] = round(srv.wait_ready(1200, since=t0), 1)
            out["both_ready_s"] = round(time.monotonic() - t0, 1)
            for srv, mode in servers:
                bench(srv, mode)
        else:
            for mode in ("eagle3", "baseline"):
                with server(mode, []) as srv:
                    out[f"{mode}_ready_s"] = round(srv.wait_ready(1200), 1)
                    out["both_ready_s"] = round(out.get("both_ready_s", 0) + out[f"{mode}_ready_s"], 1)
                    bench(srv, mode)
    out["speedup_c1"] = round(out["eagle3_tokens_per_s_c1"] / out["baseline_tokens_per_s_c1"], 3)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instance", required=True, help="DAGSTER_HOME of a finished `eagle3-assets materialize`")
    ap.add_argument("--ways", default="shipped,default")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", help="write the JSON lines here")
    a = ap.parse_args()
    work = Path(a.instance) / "host-work"
    rows = []
    for way in a.ways.split(","):
        rows.append(run(way, work, a.k))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text("".join(json.dumps({**r, "host": platform.node()}) + "\n" for r in rows))


if __name__ == "__main__":
    main()
