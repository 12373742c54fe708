"""Stage `engine_check`: can the host's engine do a job (extract, serve) for this target? Asked of its own code."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Args, Contract, EngineName, Result


class EngineCheckArgs(Args):
    engine: EngineName = Field(description="the serving engine")
    purpose: Literal["serve", "extract"] = "serve"
    target: str = Field(description="the target model directory")
    engine_python: str | None = Field(default=None, description="the host Python with the engine installed")
    # serve: the server the check stands for (a gate's, serve_bench's launch settings)
    dtype: str | None = Field(default=None, description="the server's dtype (None: the one the stages pick here)")
    extra_args: list[str] = Field(default=[], description="the server's extra arguments (an --attention-backend)")
    drafter: str | None = Field(default=None, description="serve: an export to read back as the engine reads it")
    trained_drafter: str | None = Field(default=None, description="serve: the checkpoint the export came from, "
                                        "compared with it tensor by tensor; and whether the other engines can take it")
    refuse: bool = Field(default=True, description="False: a refusal is an answer (refusal, cpu_mla), not a failure")


class EngineCheckResult(Result):
    version: str
    refusal: str | None = None  # refuse False: why the engine cannot serve, every cause in order
    cpu_mla: bool = False  # an MLA target on a host without a GPU (no engine's CPU build serves it an EAGLE-3 drafter)
    export_readback: dict | None = None  # drafter and trained_drafter: worker/serving/export.py's compare_export
    export_config_diff: list[dict] | None = None  # ... and its compare_config: [{key, export, checkpoint}]


CONTRACT = Contract(EngineCheckArgs, result=EngineCheckResult)
