"""What a serving engine is really started with, read from its command line: both halves read it (the
benchmark records it from the server's argv; the integration gate from the extra arguments it passes when the
server never came up)."""

from __future__ import annotations

import json
from pathlib import Path

# In a servers file's restart command: the path of the speculative config written beside the drafter's export
SPEC_CONFIG = "{speculative_config}"
LAUNCH_NAMES = {"vllm": "speculative_config.vllm.json", "sglang": "adaptive.sglang.json"}


def launch_file(drafter: str, engine: str) -> Path:
    """The speculative config the speculation schedule wrote beside an export (exports/<v>/<engine>-launch/)."""
    return Path(drafter).parent / f"{engine}-launch" / LAUNCH_NAMES.get(engine, LAUNCH_NAMES["sglang"])


def render(parts: list[str], drafter: str, engine: str) -> list[str]:
    """A restart command as it runs: {drafter} the export's path, {speculative_config} the path of the launch file
    beside it (FileNotFoundError when the command asks for one that is not there)."""
    parts = [part.replace("{drafter}", drafter) for part in parts]
    if any(SPEC_CONFIG in part for part in parts):
        spec = launch_file(drafter, engine)
        if not spec.is_file():
            raise FileNotFoundError(f"the restart command asks for {SPEC_CONFIG} but {spec} does not exist: "
                                    "materialize speculation_schedule for this drafter, or take the placeholder out "
                                    "of the servers file")
        parts = [part.replace(SPEC_CONFIG, str(spec)) for part in parts]
    return parts


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
        if not spec.lstrip().startswith("{") and Path(spec).is_file():  # vLLM takes a file's path as well
            spec = Path(spec).read_text()
        try:
            method = json.loads(spec).get("method")
        except (ValueError, AttributeError):
            method = f"unreadable --speculative-config {spec!r}"
    return {"served_method": method, "attention_backend": last("--attention-backend")}
