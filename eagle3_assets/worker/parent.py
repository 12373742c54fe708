"""A worker that must not outlive the process that started it (the local host's Dagster step)."""

from __future__ import annotations

import os
import signal

from ..common.worker_env import PARENT_ENV


def die_with_parent() -> None:
    """Linux sends this process SIGTERM (a stop: the stage unwinds) when the process that started it dies,
    even by kill -9: a dead control plane leaves no worker behind for its retry to run beside."""
    parent = os.environ.pop(PARENT_ENV, None)  # not for the processes this one starts
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the output lock still keeps a retry from running beside it
        return
    if os.getppid() != int(parent):  # the starter died before the line above: nobody will send the signal
        os.kill(os.getpid(), signal.SIGTERM)
