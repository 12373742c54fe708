"""The real dagster-daemon, started the way a team runs it (`dagster-daemon run`) in its own process group with the
environment the serving loop reads (servers file, gateway logs, retraining config), and stopped by that group
alone: the second story's, and the tests' and benches' that need sensors and the run queue to run for real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
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
    """SIGTERM to the daemon's process group (the daemon, its code server, the run workers they launched), then wait
    until every process of it has ended, not only the daemon: a run worker still writing its run's last events would
    race settle_runs. SIGKILL for what outlives 30 s."""
    if proc is None:
        return
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    if not _group_gone(proc.pid, 30):
        _signal_group(proc.pid, signal.SIGKILL)
        _group_gone(proc.pid, 5)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether no live process (zombies aside: an init that does not reap leaves them) is left in the group within
    `timeout_s`. Read from /proc; where there is none, only the daemon's own end was waited for."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # ended while read
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


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
        elif run.status == dg.DagsterRunStatus.FAILURE and run.tags.get(WILL_RETRY_TAG) != "false" \
                and not run.tags.get(RETRIED_BY_TAG):
            # tagged for a retry, or not yet tagged (the retry daemon decides from the failure when the tag is absent)
            instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "false"})
            log(f"failed run {run.run_id[:8]} ({run.job_name}): not retried by the next daemon")
