"""The `gpu_host` resource interface: run a worker stage on the host through Dagster Pipes, move small
files to and from the host's work directory. Stages take paths relative to that directory and answer with
small JSON; big artifacts never leave the host."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dagster as dg


@dataclass
class StageRun:
    result: dict[str, Any]  # the stage's small JSON answer
    materialization: dg.MaterializeResult | None  # what the stage reported for the asset being built
    host: str | None = None  # the pool's name of the host it ran on (recorded, so later stages can find its files)

    def materialize_result(self, **extra_metadata) -> dg.MaterializeResult:
        m = self.materialization or dg.MaterializeResult()
        placed = {"host": self.host} if self.host else {}
        return dg.MaterializeResult(metadata={**(m.metadata or {}), **placed, **extra_metadata},
                                    data_version=m.data_version)


@dataclass(frozen=True)
class Held:
    """A file or directory a stage reads that an upstream asset wrote: the asset (and partition) whose latest
    materialization made it, and its path on the host that made it (relative to the work directory, or absolute:
    a target directory). A pool of hosts brings it to the host the stage runs on (hosts/pool.py)."""
    asset: str
    path: str
    partition: str | None = None


class GpuHost(dg.ConfigurableResource):
    """Base of all hosts. `workdir` is the directory on the host under which every stage path lives."""

    workdir: str
    require_gpus: bool = False  # GPU stages refuse to start on a host where nvidia-smi lists no GPU

    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        raise NotImplementedError

    def check(self, context, gpus: bool, need_bytes: int | None = None) -> dict[str, Any]:
        """Probe the host (Python, worker dependencies and code, GPUs, free disk); a Failure naming every
        problem found, else what the probe saw."""
        raise NotImplementedError

    def bring(self, context, held: list[Held]) -> dict[str, str]:
        """Make each upstream file a stage reads present on the host this run uses; its path there by the path
        given. One host holds everything it made: nothing to move."""
        return {h.path: h.path for h in held}

    @contextmanager
    def files(self) -> Iterator[tuple[Any, str]]:
        """An fsspec filesystem onto the host and its absolute work directory, for moving artifacts between
        hosts (hosts/replicate.py)."""
        raise NotImplementedError
        yield

    def put_file(self, local_path: str, rel_path: str) -> None:
        raise NotImplementedError

    def get_file(self, rel_path: str, local_path: str) -> None:
        raise NotImplementedError

    def worker_command(self, python: str, stage: str, args: dict[str, Any]) -> list[str]:
        return [python, "-m", "eagle3_assets.worker", stage, "--workdir", self.workdir, "--args", json.dumps(args)]


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_exit(ended: dict) -> str:
    """How a worker ended, in words: exit status, or the signal that killed it and what that usually means."""
    if ended.get("vanished"):
        return "the job ended without an exit status (its supervisor was killed too, or the host restarted)"
    sig = ended.get("signal")
    if sig:
        name = ended.get("signal_name") or _signal_name(sig)
        why = {9: ": out of memory, or killed by hand", 15: ": stopped"}.get(sig, "")
        return f"the worker was killed by {name} ({sig}{why})"
    return f"the worker exited with status {ended.get('returncode')}"


def stage_outcome(stage: str, returncode: int | None, session, log_tail: str = "", how: str | None = None) -> StageRun:
    """Turn a finished worker into a StageRun, or a Failure that says what went wrong in the worker's words.
    Only a zero exit with no error reported is a success."""
    messages = session.get_custom_messages()
    errors = [m["message"] for m in messages if isinstance(m, dict) and m.get("kind") == "error"]
    if returncode != 0 or errors:
        why = errors[-1] if errors else (how or describe_exit({"returncode": returncode, "signal": -returncode
                                                                if returncode and returncode < 0 else None}))
        if log_tail and not errors:
            why += f"; the end of its log:\n{log_tail}"
        raise dg.Failure(description=f"stage {stage!r} failed: {why}",
                         metadata={"stage": stage, "exit_status": returncode if returncode is not None else "none"},
                         allow_retries=False)
    results = [m["payload"] for m in messages if isinstance(m, dict) and m.get("kind") == "result"]
    reported = [r for r in session.get_reported_results() if isinstance(r, dg.MaterializeResult)]
    return StageRun(result=results[-1] if results else {}, materialization=reported[-1] if reported else None)
