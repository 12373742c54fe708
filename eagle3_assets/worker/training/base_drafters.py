"""Base drafters shipped in the package (eagle3_assets/base_drafters/<name>/, each made by bench/base_drafter.py and
described by its lineage.json): `init_from: shipped:<name>` finetunes one instead of a directory on the host."""

from __future__ import annotations

from pathlib import Path

from ..errors import StageError
from ..files import resolve

PREFIX = "shipped:"
SHIPPED = Path(__file__).resolve().parents[2] / "base_drafters"


def shipped_names() -> list[str]:
    return sorted(d.name for d in SHIPPED.iterdir() if (d / "config.json").exists()) if SHIPPED.is_dir() else []


def init_dir(workdir: str, init_from: str) -> Path:
    """The checkpoint directory `init_from` names: a shipped base drafter, or a path on the host."""
    if not init_from.startswith(PREFIX):
        return resolve(workdir, init_from)
    name = init_from[len(PREFIX):]
    if name not in shipped_names():
        raise StageError(f"init_from {init_from!r}: no base drafter {name!r} ships with this package (shipped: "
                         f"{', '.join(shipped_names()) or 'none'}); name one of those, a drafter directory on the "
                         "host, or null to train from scratch")
    return SHIPPED / name
