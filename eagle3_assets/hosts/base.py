"""The `gpu_host` resource interface: run a worker stage on the host through Dagster Pipes, move small
files to and from the host's work directory. Stages take paths relative to that directory and answer with
small JSON; big artifacts never leave the host."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import dagster as dg


@dataclass
class StageRun:
    result: dict[str, Any]  # the stage's small JSON answer
    materialization: dg.MaterializeResult | None  # what the stage reported for the asset being built

    def materialize_result(self, **extra_metadata) -> dg.MaterializeResult:
        m = self.materialization or dg.MaterializeResult()
        return dg.MaterializeResult(metadata={**(m.metadata or {}), **extra_metadata}, data_version=m.data_version)


class GpuHost(dg.ConfigurableResource):
    """Base of all hosts. `workdir` is the directory on the host under which every stage path lives."""

    workdir: str

    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        raise NotImplementedError

    def put_file(self, local_path: str, rel_path: str) -> None:
        raise NotImplementedError

    def get_file(self, rel_path: str, local_path: str) -> None:
        raise NotImplementedError

    def worker_command(self, python: str, stage: str, args: dict[str, Any]) -> list[str]:
        return [python, "-m", "eagle3_assets.worker", stage, "--workdir", self.workdir, "--args", json.dumps(args)]


def stage_outcome(stage: str, returncode: int, session, log_tail: str = "") -> StageRun:
    """Turn a finished worker into a StageRun, or a Failure that says what went wrong in the worker's words."""
    messages = session.get_custom_messages()
    errors = [m["message"] for m in messages if isinstance(m, dict) and m.get("kind") == "error"]
    if returncode != 0 or errors:
        why = errors[-1] if errors else f"the worker exited with status {returncode} without reporting an error"
        if log_tail and not errors:
            why += f"; last output:\n{log_tail}"
        raise dg.Failure(description=f"stage {stage!r} failed: {why}",
                         metadata={"stage": stage, "exit_status": returncode}, allow_retries=False)
    results = [m["payload"] for m in messages if isinstance(m, dict) and m.get("kind") == "result"]
    reported = [r for r in session.get_reported_results() if isinstance(r, dg.MaterializeResult)]
    return StageRun(result=results[-1] if results else {}, materialization=reported[-1] if reported else None)
