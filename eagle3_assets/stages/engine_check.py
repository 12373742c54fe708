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


class EngineCheckResult(Result):
    version: str


CONTRACT = Contract(EngineCheckArgs, result=EngineCheckResult)
