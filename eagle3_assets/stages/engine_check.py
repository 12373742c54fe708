"""Stage `engine_check`: can the host's engine do a job (extract, serve) for this target? Asked of its own code."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

# The engine names, one per module of worker/engines/: its __init__ is standard library only and imports no
# engine (pyproject.toml, stages-leaf, exempts this one import). Every contract's engine choices come from here.
from ..worker.engines import DEFAULT as DEFAULT  # re-exported: serve_bench's default engine
from ..worker.engines import NAMES
from .base import Args, Result

EngineName = Literal[NAMES]  # the launchpad and --help show the choices


class EngineCheckArgs(Args):
    engine: EngineName = Field(description="the serving engine")
    purpose: Literal["serve", "extract"] = "serve"
    target: str = Field(description="the target model directory")
    engine_python: str | None = Field(default=None, description="the host Python with the engine installed")


class EngineCheckResult(Result):
    version: str
