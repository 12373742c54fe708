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
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..common import process_group, spec_schedule
from ..common.launch import launch_file, render
from ..common.secrets import scrub
from ..eye.live_acceptance import server_info
from ..eye.servers_file import Server

SCHEDULE_KEYS = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")


def launch_differs(drafter: str, engine: str, schedule: list) -> str | None:
    """Why the launch file beside this export would not start the schedule recorded for it (a later gate or sweep
    rewrote it, a hand edit), or None when it would or there is none (command() says so then)."""
    spec = launch_file(drafter, engine)
    if not spec.is_file():
        return None
    sched = [tuple(r) for r in schedule]
    want = spec_schedule.vllm_config("eagle3", "", sched) if engine == "vllm" else \
        spec_schedule.sglang_adaptive_config(sched)
    try:
        got = json.loads(spec.read_text())
    except (OSError, ValueError) as e:
        return f"{spec} cannot be read ({e})"
    if engine == "vllm" and isinstance(got, dict):  # the schedule's keys only: a team may add its own (TP, ...)
        want, got = ({k: cfg.get(k) for k in SCHEDULE_KEYS} for cfg in (want, got))
    if got == want:
        return None
    return (f"{spec} would start {spec_schedule.dumps(got) if isinstance(got, dict) else got}, but the schedule "
            f"measured for this drafter is {spec_schedule.describe(sched)} ({spec_schedule.dumps(want)})")


def command(server: Server, drafter: str) -> list[str]:
    """The restart command with {drafter} (the export's path) and {speculative_config} (the path of the file its
    speculation schedule wrote beside it: the server starts with the schedule by load measured for that drafter)."""
    return render(list(server.restart or []), drafter, server.engine)


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:  # noqa: S310 (the team's own server)
            return r.status == 200
    except OSError:
        return False


def told_drafter(server: Server) -> str | None:
    """The drafter the server says it serves (vLLM's /server_info, registered in dev mode only), or None."""
    spec = ((server_info(server) or {}).get("vllm_config") or {}).get("speculative_config") or {}
    return str(spec["model"]) if isinstance(spec, dict) and spec.get("model") else None


def run_command(argv: list[str], timeout_s: float, log: Callable[[str], None] = lambda _: None) -> str | None:
    """Run a restart command: None when it exits 0, else why not, never quoting its arguments (a team's command may
    carry a token: kubectl --token=...; messages reach the event log, the metadata and the CLI) and its output
    scrubbed. It runs in a process group of its own, killed whole on timeout: a `bash -c` wrapper's children would
    otherwise run on and switch the server after the rollout reported it rolled back.

    Its exit is what is waited for, not the end of its output: a command that starts the server in the background
    (`nohup vllm serve ... &`) leaves it holding the output, and is done. Its output goes to a file (0600) rather
    than a pipe, so such a server keeps writing somewhere once the command is gone (to a closed pipe its next log
    line would fail); the file is removed unless a process the command detached still runs, which is left alone."""
    program = scrub(os.path.basename(argv[0])) if argv else "no command"
    out = tempfile.NamedTemporaryFile(prefix="eagle3-restart-", suffix=".log", delete=False)  # noqa: SIM115
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as e:
        out.close()
        os.unlink(out.name)
        return f"its restart command ({program}) could not start: {e.strerror}"
    out.close()  # the command holds its own copy
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this Popen made: its pgid is its pid
        except ProcessLookupError:
            pass
        proc.wait()
        os.unlink(out.name)
        return (f"its restart command ({program}) did not finish within {timeout_s:g} s (restart_timeout_s in the "
                "servers file): it was killed with its whole process group")
    said = Path(out.name).read_bytes()[-4000:].decode(errors="replace")
    if process_group.alive(proc.pid):
        log(f"its restart command ({program}) left processes running (process group {proc.pid}): left alone, their "
            f"output goes to {out.name}")
    else:
        os.unlink(out.name)
    if code != 0:
        said = scrub(said.strip()[-500:])
        return f"its restart command ({program}) exited {code}" + (f": {said}" if said else "")
    return None


def restart(server: Server, drafter: str, log: Callable[[str], None]) -> str | None:
    """Restart the server with `drafter` and wait for it: None when it is up and serving it, else why not."""
    try:
        argv = command(server, drafter)
    except FileNotFoundError as e:
        return str(e)
    # the program only: a team's restart command may carry a token (kubectl --token=...), and logs are widely read
    log(f"{server.name}: restarting with {drafter} ({scrub(argv[0]) if argv else 'no command'} ...)")
    if why := run_command(argv, server.restart_timeout_s, log):
        return why
    deadline = time.monotonic() + server.ready_timeout_s
    while time.monotonic() < deadline:
        if healthy(server.url):
            told = told_drafter(server)
            if told is not None and told.rstrip("/") != drafter.rstrip("/"):
                return f"it answers but serves {told}, not {drafter}"
            return None
        time.sleep(2)
    return f"it did not answer {server.url}/health within {server.ready_timeout_s:.0f} s of its restart"
