"""The local host: the worker runs as a subprocess of the Dagster step, on this machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from ..common.worker_env import PARENT_ENV
from . import preflight
from .base import GpuHost, StageRun, stage_outcome
from .file_messages import TempFileMessages


class LocalGpuHost(GpuHost):
    """Runs stages with this machine's Python (or `python`), messages through Pipes temp files."""

    python: str = Field(default=sys.executable, description="Python interpreter that has eagle3-assets' worker deps")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the worker (e.g. CUDA_VISIBLE_DEVICES)")

    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        if self.require_gpus and stage in preflight.GPU_STAGES:
            self.check(context, gpus=True)
        # the arguments in an owner-only file (mkstemp: mode 600), never on the command line, which every user of
        # the machine can read (ps); removed once the worker has ended
        fd, args_file = tempfile.mkstemp(prefix=f"{stage}-args-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(args, f)
            cmd = [self.python, "-m", "eagle3_assets.worker", stage, "--workdir", self.workdir, "--args-file", args_file]
            with dg.open_pipes_session(context=context, context_injector=dg.PipesTempFileContextInjector(),
                                       message_reader=TempFileMessages(), extras={"stage": stage}) as session:
                # The worker stops itself if this process dies (kill -9 included): a retry never runs beside it.
                env = {**os.environ, **self.env, **session.get_bootstrap_env_vars(), PARENT_ENV: str(os.getpid())}
                # Its own process group, so that cancelling the run stops the worker and its children.
                proc = subprocess.Popen(cmd, env=env, start_new_session=True)
                try:
                    rc = proc.wait()
                except BaseException:
                    _terminate(proc)
                    raise
        finally:
            os.remove(args_file)
        return stage_outcome(stage, rc, session)

    def check(self, context, gpus: bool, need_bytes: int | None = None) -> dict[str, Any]:
        args = json.dumps({"workdir": self.workdir, "gpus": gpus})
        out = subprocess.run([self.python, "-c", preflight.PROBE_SOURCE, args], capture_output=True, text=True,
                             env={**os.environ, **self.env})
        if out.returncode != 0:
            raise dg.Failure(description=f"probing this machine with {self.python} failed: {out.stderr[-2000:]}")
        info = json.loads(out.stdout)
        found = preflight.problems(info, where="this machine", gpus=gpus, min_free_bytes=0, code="installed",
                                   need_bytes=need_bytes)
        if found:
            raise dg.Failure(description="the host is not ready:\n- " + "\n- ".join(found), allow_retries=False)
        return info

    @contextmanager
    def files(self) -> Iterator[tuple[Any, str]]:
        from fsspec.implementations.local import LocalFileSystem

        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        yield LocalFileSystem(), str(Path(self.workdir).resolve())

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
