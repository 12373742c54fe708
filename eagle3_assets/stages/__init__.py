"""One contract per worker stage (stdlib and pydantic only, shared by both halves).

The control plane's Dagster configs inherit each stage's Settings; the worker validates the stage's Args
before it imports torch and refuses a bad one naming it. Result models name the metadata keys of a
materialization that the other half reads.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from .base import Args, ArgsError, Result, explain
from .engine_check import EngineCheckArgs, EngineCheckResult
from .export import ExportArgs, ExportResult
from .extract import ExtractArgs
from .generate import GenerateArgs, GenerateResult
from .serve_bench import ServeBenchArgs, ServeBenchResult
from .speculate import SpeculateArgs, SpeculateResult
from .target import PrepareTargetArgs, PrepareTargetResult
from .train import TrainArgs, TrainResult
from .vocab import VocabArgs


@dataclass(frozen=True)
class Contract:
    args: type[Args]
    metadata: type[Result] | None = None  # what its materialization's metadata must carry
    result: type[Result] | None = None  # what its small JSON answer must carry


CONTRACTS: dict[str, Contract] = {
    "prepare_target": Contract(PrepareTargetArgs, metadata=PrepareTargetResult),
    "generate": Contract(GenerateArgs, result=GenerateResult),
    "extract": Contract(ExtractArgs),
    "vocab": Contract(VocabArgs),
    "train": Contract(TrainArgs, metadata=TrainResult),
    "export": Contract(ExportArgs, metadata=ExportResult),
    "speculate": Contract(SpeculateArgs, metadata=SpeculateResult),
    "serve_bench": Contract(ServeBenchArgs, metadata=ServeBenchResult),
    "engine_check": Contract(EngineCheckArgs, result=EngineCheckResult),
}


def validate(stage: str, raw: object) -> dict:
    """The stage's arguments with every default filled in, or ArgsError naming each bad field."""
    if stage not in CONTRACTS:
        raise ArgsError(f"unknown stage {stage!r}: one of {sorted(CONTRACTS)}")
    try:
        return CONTRACTS[stage].args.model_validate(raw).model_dump()
    except ValidationError as e:
        raise ArgsError(explain(stage, e)) from None


def check_reported(stage: str, kind: str, payload: dict) -> None:
    """A stage's materialization metadata (kind "metadata") or result (kind "result") must carry what the other
    half reads: a missing key is the stage's own bug, caught where it is made rather than downstream."""
    model = getattr(CONTRACTS[stage], kind) if stage in CONTRACTS else None
    if model is None:
        return
    try:
        model.model_validate(payload)
    except ValidationError as e:
        raise ArgsError(explain(stage, e).split(" (`python")[0].replace("arguments", kind, 1)) from None


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=", "max_length": "length <=",
           "pattern": "matching"}


def describe(stage: str) -> str:
    """The stage's arguments for `--help`: name, type, default or `required`, bounds, description."""
    model: type[BaseModel] = CONTRACTS[stage].args
    lines = [f"{stage} arguments (JSON object for --args / --args-file):"]
    for name, f in model.model_fields.items():
        default = "required" if f.is_required() else f"default {json.dumps(f.get_default(call_default_factory=True))}"
        bounds = ", ".join(f"{sym} {getattr(m, attr)}" for m in f.metadata for attr, sym in _BOUNDS.items()
                           if getattr(m, attr, None) is not None)
        lines.append(f"  {name}: {_type_name(f.annotation)}, {default}" + (f", {bounds}" if bounds else ""))
        if f.description:
            lines.append(f"      {f.description}")
    return "\n".join(lines)


__all__ = ["CONTRACTS", "ArgsError", "Contract", "check_reported", "describe", "validate"]
