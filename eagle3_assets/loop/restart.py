"""Rollout: the drafter in production put on the running servers, one at a time (rollout asset, assets/rollout.py).

Each server of the engine that lists a `restart` command in the servers file is restarted with the new export
({drafter} in the command), then must answer /health within its ready_timeout_s and, where it tells (vLLM's
/server_info in dev mode), name the new drafter; with `verify_live_drafts`, the serving eye must also have seen it
serve that many speculative steps with it. A server that fails is restarted with the drafter it had, checked
again, and the rollout stops there, naming it: the servers after it keep the old drafter.

Why restarts and not vLLM's runtime draft weight update (`/start_draft_weight_update`, vLLM 0.32, dev mode): its
transfer engines that take a draft (nccl, ipc) move CUDA tensors from a trainer process, and none runs on a CPU
build; the restart path runs everywhere and is what SGLang offers (no draft hot-swap there)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable

from ..eye.servers_file import Server


def command(server: Server, drafter: str) -> list[str]:
    return [part.replace("{drafter}", drafter) for part in server.restart or []]


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:  # noqa: S310 (the team's own server)
            return r.status == 200
    except OSError:
        return False


def told_drafter(server: Server) -> str | None:
    """The drafter the server says it serves (vLLM's /server_info, registered in dev mode only), or None."""
    try:
        with urllib.request.urlopen(f"{server.url}/server_info?config_format=json", timeout=server.timeout_s) as r:  # noqa: S310
            spec = (json.loads(r.read()).get("vllm_config") or {}).get("speculative_config") or {}
        return str(spec["model"]) if isinstance(spec, dict) and spec.get("model") else None
    except (OSError, ValueError):
        return None


def restart(server: Server, drafter: str, log: Callable[[str], None], timeout_s: float = 600) -> str | None:
    """Restart the server with `drafter` and wait for it: None when it is up and serving it, else why not."""
    argv = command(server, drafter)
    # the program only: a team's restart command may carry a token (kubectl --token=...), and logs are widely read
    log(f"{server.name}: restarting with {drafter} ({argv[0] if argv else 'no command'} ...)")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"its restart command failed: {type(e).__name__}: {e}"
    if done.returncode != 0:
        return f"its restart command exited {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}"
    deadline = time.monotonic() + server.ready_timeout_s
    while time.monotonic() < deadline:
        if healthy(server.url):
            told = told_drafter(server)
            if told is not None and told.rstrip("/") != drafter.rstrip("/"):
                return f"it answers but serves {told}, not {drafter}"
            return None
        time.sleep(2)
    return f"it did not answer {server.url}/health within {server.ready_timeout_s:.0f} s of its restart"
