"""The real dagster-daemon on the project's workspace.yaml, for the tests and benches that need sensors and the run
queue to run for real (tests/pool_harness.py, tests/serving/test_serving_eye.py): started in its own process group
and stopped by that group alone (eagle3_assets/story/daemon.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from eagle3_assets.story.daemon import start_daemon as _start
from eagle3_assets.story.daemon import stop_daemon

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["ROOT", "start_daemon", "stop_daemon"]


def start_daemon(env: dict, log: Path) -> subprocess.Popen:
    return _start(env, log, ROOT / "workspace.yaml", ROOT)
