"""A process group's state, for what both halves start in a group of its own (engine servers, restart commands).
Standard library only."""

from __future__ import annotations

import os


def alive(pgid: int) -> bool:
    """Whether any process of the group still runs (one that changed its user counts: it cannot be signalled)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
