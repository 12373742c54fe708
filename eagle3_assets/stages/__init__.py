"""One contract per worker stage (stdlib and pydantic only, shared by both halves).

The control plane's Dagster configs inherit each stage's Settings; the worker validates the stage's Args
before it imports torch and refuses a bad one naming it. Result models name the metadata keys of a
materialization that the other half reads.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import types
import typing
from pathlib import Path

from pydantic import BaseModel, ValidationError

from .base import ArgsError, Contract, explain

# One module per stage, named after it; none is imported until its stage is asked for, so that the modules
# reading a contract (the worker's entry point, its reporter) depend on that stage's contract alone: a change
# to one contract gives new code versions only to the assets running that stage (code_versions.py).
NAMES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                                      if m.name != "base"))


def contract(stage: str) -> Contract:
    if stage not in NAMES:
        raise ArgsError(f"unknown stage {stage!r}: one of {list(NAMES)}")
    return importlib.import_module(f"{__name__}.{stage}").CONTRACT


def validate(stage: str, raw: object):
    """The stage's Args model with every default filled in, or ArgsError naming each bad field."""
    try:
        return contract(stage).args.model_validate(raw)
    except ValidationError as e:
        raise ArgsError(explain(stage, e)) from None


def check_reported(stage: str, kind: str, payload: dict) -> None:
    """A stage's materialization metadata (kind "metadata") or result (kind "result") must carry what the other
    half reads: a missing key is the stage's own bug, caught where it is made rather than downstream."""
    model = getattr(contract(stage), kind) if stage in NAMES else None
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
    model: type[BaseModel] = contract(stage).args
    lines = [f"{stage} arguments (JSON object for --args / --args-file):"]
    for name, f in model.model_fields.items():
        default = "required" if f.is_required() else f"default {json.dumps(f.get_default(call_default_factory=True))}"
        bounds = ", ".join(f"{sym} {getattr(m, attr)}" for m in f.metadata for attr, sym in _BOUNDS.items()
                           if getattr(m, attr, None) is not None)
        lines.append(f"  {name}: {_type_name(f.annotation)}, {default}" + (f", {bounds}" if bounds else ""))
        if f.description:
            lines.append(f"      {f.description}")
    return "\n".join(lines)


__all__ = ["NAMES", "ArgsError", "Contract", "check_reported", "contract", "describe", "validate"]
