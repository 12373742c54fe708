"""The local host: the worker runs as a subprocess of the Dagster step, on this machine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from .base import GpuHost, StageRun, stage_outcome


class LocalGpuHost(GpuHost):
    """Runs stages with this machine's Python (or `python`), messages through Pipes temp files."""

    python: str = Field(default=sys.executable, description="Python interpreter that has eagle3-assets' worker deps")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the worker (e.g. CUDA_VISIBLE_DEVICES)")

    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        cmd = self.worker_command(self.python, stage, args)
        with dg.open_pipes_session(context=context, context_injector=dg.PipesTempFileContextInjector(),
                                   message_reader=dg.PipesTempFileMessageReader(),
                                   extras={"stage": stage}) as session:
            env = {**os.environ, **self.env, **session.get_bootstrap_env_vars()}
            # Its own process group, so that cancelling the run stops the worker and its children.
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            try:
                rc = proc.wait()
            except BaseException:
                _terminate(proc)
                raise
        return stage_outcome(stage, rc, session)

    def put_file(self, local_path: str, rel_path: str) -> None:
        dest = Path(self.workdir) / rel_path
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".tmp-{dest.name}")
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)

    def get_file(self, rel_path: str, local_path: str) -> None:
        shutil.copyfile(Path(self.workdir) / rel_path, local_path)


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
