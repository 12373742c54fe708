"""Stage `export`: the trained drafter in each serving engine's dialect, validated against its contract."""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import NAMES, Args, Contract, Result, Settings


class ExportSettings(Settings):
    # list[str], checked against the engine names: Dagster's config has no list of a Literal
    dialects: list[str] | None = Field(default=None, min_length=1, description="serving engines to export for: "
                                       + ", ".join(NAMES) + " (default: every one that can serve the drafter as "
                                       "trained; the others are left out, the reason in <dialect>_left_out)")

    @field_validator("dialects")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        unknown = [d for d in v or [] if d not in NAMES]
        if unknown:
            raise ValueError(f"unknown dialects {unknown}: the engines are {list(NAMES)}")
        return v


class ExportArgs(Args, ExportSettings):
    drafter: str = Field(description="the trained drafter's model directory")
    target: str = Field(description="the target model directory")
    out: str = Field(description="exports go to <out>/<dialect>")


class ExportResult(Result):
    source: str  # the canonical checkpoint exported; each dialect adds <dialect>_path


CONTRACT = Contract(ExportArgs, metadata=ExportResult)
