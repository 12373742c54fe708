"""A backfill of 4 hidden-state shards over one host and over two: the run per shard (host, start, end in
seconds from the backfill's launch) and the backfill's wall time. Each host is a real sshd on 127.0.0.1 with
its own work directory, the runs go through the real daemon's queue with the shipped per-host run limit, and
the backfill is launched with `dagster job backfill` (the harness of tests/hosts/test_host_pool.py). On one
machine the two "hosts" share its cores: the figure shows the queue's placement and overlap, not a speed-up
that needs two machines.

    python bench/backfill_hosts.py            # -> bench/results/backfill_hosts.json
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from pool_harness import PREPARE, TERMINAL, Pool, host_timeline  # noqa: E402
from ssh_server import SshServer  # noqa: E402


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def one(hosts: list[str], root: Path) -> dict:
    servers = {name: SshServer(root / f"sshd-{name}").start() for name in hosts}
    pool = Pool(root, servers)
    try:
        res = pool.materialize(*PREPARE)
        assert res.success
        pool.start_daemon()
        t0 = pool.backfill()
        runs = pool.wait(lambda: (rs := pool.runs_since(t0, "extract_hidden_states")) and len(rs) == 4
                         and all(r.dagster_run.status in TERMINAL for r in rs) and rs, 900, "the backfill's 4 runs")
        timeline = host_timeline(runs)
        return {"hosts": len(hosts),
                "runs": {h: [{"shard": k, "start_s": round(s - t0, 1), "end_s": round(e - t0, 1)} for s, e, k in v]
                         for h, v in timeline.items()},
                "wall_s": round(max(r.end_time for r in runs) - t0, 1),
                "all_succeeded": all(r.dagster_run.status.value == "SUCCESS" for r in runs)}
    finally:
        pool.stop_daemon()
        for s in servers.values():
            s.stop()


def main() -> None:
    out = {"cpu": _cpu(), "cores": len(__import__("os").sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d"),
           "shards": 4, "runs": []}
    for hosts in (["a"], ["a", "b"]):
        with tempfile.TemporaryDirectory(prefix="backfill-hosts-") as d:
            r = one(hosts, Path(d))
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
    path = ROOT / "bench" / "results" / "backfill_hosts.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
