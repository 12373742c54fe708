"""The serving engines' names, listed from their modules under worker/engines/ without importing any (an
engine runs in its own environment): the stage contracts' choices, the serving partitions, the CLI. The
engines themselves and the interface they implement are the worker's (worker/engines/__init__.py). The
helpers beside the engines (`SHARED`) are not engines: the load generator, the server process, the
extraction dump both engines write."""

from __future__ import annotations

import pkgutil
from pathlib import Path

SHARED = frozenset({"load", "server", "dump"})
_DIR = Path(__file__).resolve().parent.parent / "worker" / "engines"
# The reference engine, listed first: the one this project runs and tests for real (the main command's and the
# nightly benchmark's engine, drafter_export's default first dialect).
DEFAULT = "vllm"


def _discover() -> tuple[str, ...]:
    found = sorted(m.name for m in pkgutil.iter_modules([str(_DIR)])
                   if not m.name.startswith("_") and m.name not in SHARED)
    return tuple(sorted(found, key=lambda n: n != DEFAULT))


NAMES: tuple[str, ...] = _discover()
