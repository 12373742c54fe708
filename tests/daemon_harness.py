"""The real dagster-daemon, started the way a team runs it (`dagster-daemon run -w workspace.yaml`) in its own
process group, and stopped by that group alone: used by the tests and benches that need sensors and the run
queue to run for real (tests/pool_harness.py, tests/serving/test_serving_eye.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_daemon(env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(["dagster-daemon", "run", "-w", str(ROOT / "workspace.yaml")], cwd=ROOT, env=env,
                            start_new_session=True, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def stop_daemon(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own process group: the daemon and its code server
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
