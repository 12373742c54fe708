"""Stage `export`: the trained drafter in each serving engine's dialect, validated against its contract."""

from __future__ import annotations

from pydantic import Field

from .base import Args, Result, Settings


class ExportSettings(Settings):
    dialects: list[str] = Field(default=["vllm", "sglang"], min_length=1, description="serving engines to export for")


class ExportArgs(Args, ExportSettings):
    drafter: str = Field(description="the trained drafter's model directory")
    target: str = Field(description="the target model directory")
    out: str = Field(description="exports go to <out>/<dialect>")


class ExportResult(Result):
    source: str  # the canonical checkpoint exported; each dialect adds <dialect>_path
