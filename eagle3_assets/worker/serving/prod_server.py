"""A production vLLM server run as a team runs one under a service manager: `start` launches it detached (its own
process group, its pid in a file), `restart --drafter PATH` stops that group and starts it again serving another
drafter on the same port, as `systemctl restart` would; it does not wait for the server (the rollout checks its
health). The rollout's `restart` command in the second story's servers file and the tests' (built by
eagle3_assets/story/serving_loop.py: restart_command). Not a stage: a script for the serving machine.

    python -m eagle3_assets.worker.serving.prod_server restart --dir DIR --port 8000 --target T --drafter D
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..engines import vllm


def stop(d: Path) -> None:
    pidfile = d / "server.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)  # the group this script started, by its pid
    except ProcessLookupError:
        pidfile.unlink()
        return
    for _ in range(60):
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.killpg(pid, signal.SIGKILL)
    pidfile.unlink()


def start(d: Path, port: int, target: str, drafter: str, spec_config: str | None = None) -> int:
    """`spec_config`: a speculative config file (the speculation schedule's) the server starts with, its drafter
    path replaced by `drafter` (this machine's copy); else k = 3 at every batch size."""
    # each response carries its own acceptance: the gateway's log holds it
    extra = ["--enforce-eager", "--per-request-spec-decode-metrics", "summary"]
    argv = vllm.server_command(sys.executable, target, port, drafter=None if spec_config else drafter, k=3,
                               dtype="float32", max_model_len=1024, seed=0,
                               extra=vllm.with_k0_plugin(extra) if spec_config else extra)
    if spec_config:
        cfg = {**json.loads(Path(spec_config).read_text()), "model": drafter}
        argv += ["--speculative-config", json.dumps(cfg)]
    log = open(d / "server.log", "ab")
    proc = subprocess.Popen(argv, env={**os.environ, **vllm.SERVER_ENV}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    (d / "server.pid").write_text(str(proc.pid))
    (d / "drafter").write_text(drafter)
    return proc.pid


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3_assets.worker.serving.prod_server")
    ap.add_argument("action", choices=["start", "restart", "stop"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int)
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--speculative-config", help="a speculative config file to start with (the speculation "
                    "schedule's speculative_config.vllm.json: {speculative_config} in a restart command)")
    ap.add_argument("--drafter-root", help="this machine's copy of the exports: the drafter is read from "
                    "<root>/<its export directory>/<dialect> (a drafter nobody copied there is missing)")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    stop(d)
    if a.action != "stop":
        drafter = a.drafter
        if a.drafter_root:  # where this machine keeps its copies of the exports
            drafter = str(Path(a.drafter_root) / Path(drafter).parent.name / Path(drafter).name)
        start(d, a.port, a.target, drafter, a.speculative_config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
