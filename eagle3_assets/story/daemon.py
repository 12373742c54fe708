"""The real dagster-daemon, started the way a team runs it (`dagster-daemon run`) in its own process group with the
environment the serving loop reads (servers file, gateway logs, retraining config), and stopped by that group
alone: the second story's, and the tests' and benches' that need sensors and the run queue to run for real."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def start_daemon(env: dict, log: Path, workspace: Path | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """`dagster-daemon run -w workspace` (the project's workspace.yaml), else on the package's definitions."""
    where = ["-w", str(workspace)] if workspace else ["-m", "eagle3_assets.definitions"]
    return subprocess.Popen(["dagster-daemon", "run", *where], cwd=cwd, env=env, start_new_session=True,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def stop_daemon(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own process group: the daemon and its code server
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
