"""A gpu_host that runs each stage in the Dagster step's own process, through a real Pipes session: the shared
fixtures and the tests about a stage use it, the tests about the host boundary use the real hosts (tests/hosts/,
the main command, the UI). A worker process spends ~5 s importing torch and transformers before it starts; the
fixtures alone run some twenty stages."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_assets.hosts import LocalGpuHost
from eagle3_assets.hosts.base import StageRun, stage_outcome
from eagle3_assets.hosts.file_messages import TempFileMessages


class InProcessGpuHost(LocalGpuHost):
    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        import torch
        from dagster_pipes import PipesContext

        from eagle3_assets.worker import __main__ as entry

        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        with dg.open_pipes_session(context=context, context_injector=dg.PipesTempFileContextInjector(),
                                   message_reader=TempFileMessages(),
                                   extras={"stage": stage}) as session:
            env = {**self.env, **session.get_bootstrap_env_vars(), "EAGLE3_NO_BAR": "1"}
            saved, deterministic = {k: os.environ.get(k) for k in env}, torch.are_deterministic_algorithms_enabled()
            os.environ.update(env)
            try:
                rc = entry.run(entry._parse([stage, "--workdir", self.workdir, "--args", json.dumps(args)]))
            finally:  # what a worker process would have taken with it when it ended
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
                PipesContext._instance = None  # a closed context stays registered in the process otherwise
                torch.use_deterministic_algorithms(deterministic)
        return stage_outcome(stage, rc, session)
