"""The real dagster-daemon, started the way a team runs it (`dagster-daemon run`) in its own process group with the
environment the serving loop reads (servers file, gateway logs, retraining config), and stopped by that group
alone: the second story's, and the tests' and benches' that need sensors and the run queue to run for real."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg

# Dagster's own run tags (dagster._core.storage.tags): whether the run-retry daemon retries a failed run, and the retry
WILL_RETRY_TAG, RETRIED_BY_TAG = "dagster/will_retry", "dagster/auto_retry_run_id"


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


def settle_runs(instance: dg.DagsterInstance, since: float, log: Callable[[str], None] = print) -> None:
    """After its daemon stopped: the runs its sensors started since `since` that had not ended are marked canceled,
    and those the stop failed (a run worker killed mid-run fails, marked for retry) are not retried, so the next
    daemon on this instance neither launches nor retries them. Runs others launched are left alone."""
    for run in instance.get_runs(dg.RunsFilter(created_after=datetime.fromtimestamp(since, tz=timezone.utc))):
        if not run.tags.get("dagster/sensor_name"):
            continue
        if not run.is_finished:
            instance.report_run_canceled(run, message="the story ended: its daemon stopped")
            log(f"canceled run {run.run_id[:8]} ({run.job_name}): the story's daemon stopped before it ended")
        elif run.status == dg.DagsterRunStatus.FAILURE and run.tags.get(WILL_RETRY_TAG) == "true" \
                and not run.tags.get(RETRIED_BY_TAG):
            instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "false"})
            log(f"run {run.run_id[:8]} ({run.job_name}) failed as the story's daemon stopped: not retried")
