"""What the serving eye costs: one scrape of a production server (the live acceptance sensor's work per server and
tick: /metrics and /server_info read, differenced, tied to the drafter's checkpoint and benchmark in the instance),
one live drift judgement (the live drift sensor's per server and tick: Dagster's records only), and one offline drift
check (a `traffic_acceptance` replay, read from the runs the instance holds).

Run it on an instance that watched a server (tests/serving/test_serving_eye.py leaves one: production0/ under
pytest's temporary directory); it starts a vLLM server of its own serving that instance's drafter export:

    python bench/serving_eye_costs.py --home /tmp/pytest-of-root/pytest-N/production0/dagster_home \\
        --servers /tmp/pytest-of-root/pytest-N/production0/servers.yaml --out bench/results/serving_eye_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            extra = ", ".join(f for f in ("avx512_bf16", "avx512f", "amx_tile") if f in flags) or "avx2 only"
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores; {extra})"
    return platform.processor()


def _ms(fn, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return {"n": n, "median_ms": round(statistics.median(times), 2), "max_ms": round(max(times), 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.update(DAGSTER_HOME=args.home, EAGLE3_SERVERS=args.servers)
    import dagster as dg

    from eagle3_assets.eye import drift, live_acceptance, served
    from eagle3_assets.eye.servers_file import load_servers
    from eagle3_assets.worker.engines import vllm
    from eagle3_assets.worker.engines.server import EngineServer, free_port

    parsed = load_servers(args.servers)
    out: dict = {"cpu": _cpu(), "date": time.strftime("%Y-%m-%d")}
    with dg.DagsterInstance.get() as instance:
        export = served.meta(instance.fetch_materializations(served.EXPORT, limit=1).records[0])
        target = served.meta(instance.fetch_materializations(dg.AssetKey("target_model"), limit=1).records[0])["path"]
        port = free_port()
        log = Path(tempfile.mkdtemp()) / "server.log"
        argv = vllm.server_command(sys.executable, target, port, drafter=export["vllm_path"], k=3, dtype="float32",
                                   max_model_len=1024, seed=0, extra=["--enforce-eager"])
        with EngineServer("bench", argv, port, log, env=vllm.SERVER_ENV) as srv:
            srv.wait_ready(600)
            server = parsed.servers[0].model_copy(update={"url": srv.base_url, "drafter": export["vllm_path"]})
            out["scrape"] = _ms(lambda: live_acceptance.tick([server], None, instance), args.n)
            out["scrape_http_only"] = _ms(lambda: live_acceptance.read(server), args.n)
        out["live_judgement"] = _ms(lambda: drift.live_state(instance, parsed.servers[0], parsed.drift, time.time()),
                                    args.n)
        out["observations_in_instance"] = len(served.observations(instance, parsed.servers[0].name))
        checks = []
        for run in instance.get_runs(dg.RunsFilter(job_name="check_traffic")):
            stats = instance.get_run_stats(run.run_id)
            recs = instance.fetch_materializations(drift.REPLAY, limit=50).records
            meta = next((served.meta(r) for r in recs if r.run_id == run.run_id), {})
            checks.append({"run_s": round(stats.end_time - stats.start_time, 1) if stats.end_time else None,
                           "replay_wall_s": meta.get("wall_s"), "prompts": meta.get("prompts"),
                           "eval_reference": meta.get("eval_reference")})
        out["offline_check"] = checks
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
