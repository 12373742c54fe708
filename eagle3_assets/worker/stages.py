"""The stage registry: name -> module with `run(workdir, args, reporter)` (`args`: the stage's Args model).
Imported lazily so that `--help` and argument errors do not pay for importing torch; `run_stage` is the one
way in, arguments checked against the stage's contract (eagle3_assets/stages) first."""

from __future__ import annotations

import importlib

from ..stages import validate


def _lazy(module: str):
    def run(workdir, args, reporter):
        return importlib.import_module(f"{__package__}.{module}").run(workdir, args, reporter)

    return run


STAGES = {
    "prepare_target": _lazy("target.prepare"),
    "generate": _lazy("data.generate"),
    "vocab": _lazy("data.vocab"),
    "synthesize": _lazy("data.synthesize"),
    "traffic_sample": _lazy("data.traffic_sample"),
    "traffic_split": _lazy("data.traffic_split"),
    "extract": _lazy("hidden_states.extract"),
    "integration_data": _lazy("hidden_states.integration_data"),
    "train": _lazy("training.trainer"),
    "export": _lazy("serving.export"),
    "speculate": _lazy("serving.speculate"),
    "traffic_replay": _lazy("serving.traffic_replay"),
    "serve_bench": _lazy("serving.bench"),
    "serve_compare": _lazy("serving.compare"),
    "load_curve": _lazy("serving.load_curve"),
    "engine_check": _lazy("serving.engine_check"),
}


def run_stage(stage: str, workdir: str, raw_args: dict, reporter) -> None:
    """Validate the arguments (ArgsError names each bad one), fill in the defaults, run the stage with its
    contract's Args model."""
    STAGES[stage](workdir, validate(stage, raw_args), reporter)
