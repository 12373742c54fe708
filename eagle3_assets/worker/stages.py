"""The stage registry: name -> module with `run(workdir, args, reporter)`. Imported lazily so that
`--help` and argument errors do not pay for importing torch."""

from __future__ import annotations

import importlib


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
