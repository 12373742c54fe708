"""What a serving engine is really started with, read from its command line: both halves read it (the
benchmark records it from the server's argv; the integration gate from the extra arguments it passes when the
server never came up)."""

from __future__ import annotations

import json


def launch_facts(argv: list[str]) -> dict:
    """The speculative method (vLLM's --speculative-config JSON, SGLang's --speculative-algorithm) and the
    attention backend (None: not set there, the engine's own choice). The last of a repeated flag wins, as
    argparse takes it."""
    def last(flag: str) -> str | None:
        values = [(i, argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == flag]
        values += [(i, a.split("=", 1)[1]) for i, a in enumerate(argv) if a.startswith(flag + "=")]
        return max(values)[1] if values else None

    method = last("--speculative-algorithm")
    if (spec := last("--speculative-config")) is not None:
        try:
            method = json.loads(spec).get("method")
        except (ValueError, AttributeError):
            method = f"unreadable --speculative-config {spec!r}"
    return {"served_method": method, "attention_backend": last("--attention-backend")}
