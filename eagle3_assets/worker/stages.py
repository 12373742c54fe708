"""The stage registry: name -> module with `run(workdir, args, reporter)`. Imported lazily so that
`--help` and argument errors do not pay for importing torch; `run_stage` is the one way in, arguments
checked against the stage's contract (eagle3_assets/stages) first."""

from __future__ import annotations

import importlib

from ..stages import validate


def _lazy(module: str):
    def run(workdir, args, reporter):
        return importlib.import_module(f"{__package__}.{module}").run(workdir, args, reporter)

    return run


STAGES = {
    "prepare_target": _lazy("target"),
    "generate": _lazy("generate"),
    "extract": _lazy("extract"),
    "vocab": _lazy("vocab"),
    "train": _lazy("train"),
    "export": _lazy("export"),
    "speculate": _lazy("speculate"),
    "serve_bench": _lazy("serve_bench"),
    "engine_check": _lazy("engine_check"),
}


def run_stage(stage: str, workdir: str, raw_args: dict, reporter) -> None:
    """Validate the arguments (ArgsError names each bad one), fill in the defaults, run the stage."""
    STAGES[stage](workdir, validate(stage, raw_args), reporter)
