"""What every stage contract shares: strict models, and one readable error for a bad argument.

A stage's `Settings` are what a user chooses (the Dagster config of its asset inherits them, so the launchpad
shows the same fields, bounds and descriptions); its `Args` add what the asset fills in (host paths, partition
keys) and are what the worker validates before importing torch. A default lives here and nowhere else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..common import engines, secrets

# The engines' names (common/engines.py lists them from worker/engines/): every contract's engine choices, shown
# by the launchpad and --help.
NAMES = engines.NAMES
EngineName = Literal[NAMES]
DEFAULT_ENGINE = engines.DEFAULT  # serve_bench's
# What offline acceptance and the engines' benchmark must share, or their figures cannot be compared.
NUM_SPECULATIVE_TOKENS = 3  # draft tokens per step
EVAL_NEW_TOKENS = 64  # generated tokens per prompt

# A name that becomes one directory under the host work directory: letters, digits, '-', '_', and dots only
# between them (no '.', '..', hidden names or separators).
PLAIN_NAME = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


def plain_name(name: str) -> str:
    if not re.fullmatch(PLAIN_NAME, name):
        raise ValueError(f"{name!r} is not a plain name: use letters, digits, '-', '_' and single dots between them, "
                         "no '..' and no '/' (it names one directory under the host work directory)")
    return name
DTYPE_HELP = "auto: bfloat16 on a GPU or a CPU with bf16 instructions, else float32"


class Settings(BaseModel):
    # hide_input_in_errors: a refused value (a secret, below) must not be quoted by the error that refuses it
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data):
        """A run config is shown by the UI and kept with the run, and stage arguments reach the host: no secret
        in either, by value anywhere, or by name in a mapping (a server's `env`)."""
        if isinstance(data, dict):
            found = [hit for field, value in data.items()
                     for hit in secrets.find_secrets(value, str(field), names=isinstance(value, dict))]
            if found:
                raise ValueError(f"{'; '.join(found)} (not shown): {secrets.WHERE_SECRETS_GO}")
        return data


class EngineLaunch(Settings):
    """What every stage that starts a serving engine launches it with, one setting for them all."""
    language_model_only: bool | None = Field(
        default=None, description="vLLM: serve a multimodal wrapper's text model alone (--language-model-only: "
        "no vision tower, whose config the engine may not fully read). None: on for a wrapper (text_config in its "
        "config.json) when the installed vLLM has the flag; recorded in each stage's metadata")


class Args(Settings):
    """The worker's side: unknown keys are refused (a misspelt setting would otherwise be silently ignored)."""


class Result(BaseModel):
    """The metadata keys of a stage's materialization that the other half reads; more may be present."""

    model_config = ConfigDict(extra="allow")


class ArgsError(ValueError):
    """A stage's arguments do not fit its contract; the message names every bad field."""


def explain(stage: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(arguments)"
        if e["type"] == "missing":
            lines.append(f"{where}: required, missing")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{where}: not a {stage} argument")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if e["type"] == "value_error" else f"{where}: {msg}, got {e.get('input')!r}")
    return f"bad {stage} arguments: " + "; ".join(lines) + \
        f" (`python -m eagle3_assets.worker {stage} --help` lists them)"


@dataclass(frozen=True)
class Contract:
    """A stage's contract, one per module of this package named after the stage (`CONTRACT` there)."""
    args: type[Args]
    metadata: type[Result] | None = None  # what its materialization's metadata must carry
    result: type[Result] | None = None  # what its small JSON answer must carry
    # arguments naming files on the host that no upstream asset versions (a target directory given by path): a
    # finished job on the host is reused only while they are as they were when it started (worker/jobs.py)
    host_sources: tuple[str, ...] = ()
