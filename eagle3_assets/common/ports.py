"""A free TCP port on 127.0.0.1: for the servers the worker starts and the ones the second story starts."""

from __future__ import annotations

import socket


def free_port(taken: list[int] | tuple[int, ...] = ()) -> int:
    """A port free now on 127.0.0.1, other than those in `taken` (given to servers not started yet)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
