"""An inference server process on the host: started in its own process group with its output in a log
file, waited on until it answers its health route, and stopped with its whole group, whatever happens
(an error, a cancel, the worker killed), so that no process or GPU memory is left behind. And the question
asked before one starts: can the installed engine do the job (`check_support`, running an engine's probe), and
for EAGLE-3, would its server live past loading the drafter (`serve_preflight`)."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...common import process_group
from ...common.ports import free_port  # noqa: F401 (the stages and tests take it from here)
from ..errors import StageError

# Where a yes from an engine's probe is kept: the probe imports the engine (30-60 s on a 2-core CPU), and the
# main command asks the same engine the same question before generating and again before benchmarking.
_CACHE_ENV = "EAGLE3_ENGINE_CHECK_CACHE"  # a directory, or 0 to probe every time


def _installed(python: str, module: str) -> str | None:
    """The engine's installed copy as the engine's Python finds it, without importing it: the path and
    modification time of its package, so that an upgrade or reinstall is another key. None if not found."""
    code = ("import importlib.util as u, os, sys\ns = u.find_spec(sys.argv[1])\n"
            "print(f'{s.origin}:{os.stat(s.origin).st_mtime_ns}' if s and s.origin else '')")
    try:
        done = subprocess.run([python, "-c", code, module], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _cached_answer(engine, python: str, question: list[str]) -> tuple[Path | None, dict | None]:
    """(cache file, the kept answer if there is one) for this engine install and question."""
    where = os.environ.get(_CACHE_ENV, str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                           / "eagle3-assets" / "engine-support"))
    installed = _installed(python, engine.NAME) if where != "0" else None  # NAME: its module
    if installed is None:
        return None, None
    import hashlib

    key = hashlib.sha256(json.dumps([os.path.realpath(python), installed, *question]).encode()).hexdigest()[:32]
    path = Path(where) / f"{engine.NAME}-{key}.json"
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError):
        return path, None


def _advice(engine, info: dict, purpose: str, model_type: str) -> str:
    """What to do about a probe's no: a rename for a name spelled otherwise, another engine or backend for the
    target's own shape (a width no release is known to take: an upgrade is no advice there), an upgrade for what
    the release lacks; the other engines (or backends) that can take the drafter (`info["unavailable_engines"]`
    names those that cannot, and why: advice that cannot work here is none)."""
    from . import NAMES

    serving = purpose.startswith("serve")
    unavailable = info.get("unavailable_engines") or {}
    others = [n for n in (NAMES if serving else ("hf", *NAMES)) if n != engine.NAME and n not in unavailable]
    other = f"the other {'engine' if serving else 'backend'} ({', '.join(others)})" if others else ""
    shape = set(info.get("target_shape_reasons") or [])
    rename = info.get("close_spelling")
    rest = [r for r in info["reasons"] if r not in shape and not (rename and repr(rename) in r)]
    steps = ["fix the target's config.json as said"] if rename else []
    if rest:
        steps.append(f"upgrade {engine.NAME} to a release that supports "
                     f"{'EAGLE-3' if serving else 'hidden-state extraction'} for {model_type}")
    if shape:
        steps.append(f"the refusal about its shape is about this target, not this {engine.NAME} release: use "
                     + (f"{other}, or " if other else "") + "a target of a shape it takes")
        said = "; ".join(steps)
    elif other:
        said = "; ".join(steps) + f", or use {other}" if steps else f"use {other}"
    else:
        said = "; ".join(steps)
    if unavailable:  # the engines left out, said once so that nobody tries them
        said += ("; " if said else "") + "no other engine can serve this drafter (" + "; ".join(
            f"{n}: {why}" for n, why in unavailable.items()) + ")"
    return said[:1].upper() + said[1:]


def probe_answer(engine, python: str, target: Path, probe: str | None = None, purpose: str = "serve EAGLE-3",
                 launch: list[str] = ()) -> dict:
    """The installed engine's answer (its serving probe, or `probe`), a no included (`supported`, `reasons`);
    a StageError only when it cannot be asked (no such Python, not installed, the probe failed). `launch`: the
    server's extra_args, for the facts that depend on them (vLLM: the attention backend asked for). A yes is kept
    per engine install (path and mtime), probe and question, so the next stage that asks gets it at once; a no
    is asked again every time."""
    cfg = json.loads((target / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    model_type = cfg.get("model_type", "?")
    text_arch = ((cfg.get("text_config") or {}).get("architectures") or [arch])[0]
    from . import target_shapes

    shapes = json.dumps(target_shapes(cfg), sort_keys=True)
    question = [arch, model_type, text_arch, shapes] + ([json.dumps(list(launch))] if launch else [])
    code = probe or engine.SUPPORT_PROBE
    if shutil.which(python) is None:
        raise StageError(f"engine_python {python!r} does not exist on the host: point it at the Python of the "
                         f"environment where {engine.NAME} is installed")
    cache, kept = _cached_answer(engine, python, [code, *question])
    if kept is not None:
        return {**kept, "checked": "kept from an earlier probe of this install"}
    try:
        done = subprocess.run([python, "-c", code, *question], capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise StageError(f"engine_python {python!r} does not exist on the host: point it at the Python of the "
                         f"environment where {engine.NAME} is installed") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise StageError(f"asking {engine.NAME} in {python} whether it can {purpose} failed: {done.stderr[-2000:]}")
    info = json.loads(lines[-1])
    if not info.get("installed"):
        raise StageError(f"{engine.NAME} is not installed for {python} ({info.get('error')}): install it there "
                         f"({engine.INSTALL}), or set engine_python to the environment that has it")
    if info["supported"] and cache is not None:
        from ..files import atomic_file

        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(cache) as tmp:
                tmp.write_text(json.dumps(info))
        except OSError:
            pass  # a read-only home: probe again next time
    return info


def check_support(engine, python: str, target: Path, probe: str | None = None, purpose: str = "serve EAGLE-3",
                  unavailable: dict[str, str] | None = None) -> dict:
    """`probe_answer`, a no raised: a StageError that names the version, the model type and what to do
    (`unavailable`: the other engines that cannot take the drafter, and why)."""
    info = probe_answer(engine, python, target, probe, purpose)
    if not info["supported"]:
        cfg = json.loads((target / "config.json").read_text())
        arch, model_type = (cfg.get("architectures") or ["?"])[0], cfg.get("model_type", "?")
        info = {**info, "unavailable_engines": unavailable or {}}
        raise StageError(
            f"{engine.NAME} {info['version']} cannot {purpose} for this target (architecture {arch}, model_type "
            f"{model_type!r}): {'; '.join(info['reasons'])}. {_advice(engine, info, purpose, model_type)}")
    return info


def serve_refusal(engine, python: str, target: Path, *, dtype: str | None = None, extra: list[str] = (),
                  unavailable: dict[str, str] | None = None) -> tuple[str | None, dict]:
    """(why the EAGLE-3 server would not live, or None; the probe's answer). Every cause found, in the order
    the server meets them: what it refuses at start (the support probe's no, the target's shape apart), what it
    dies of loading the drafter or setting up its caches (the engine's `serve_refusals`), then what fails the
    first request (the target's shape: an MLA width the kernels refuse). `unavailable`: the other engines that
    cannot take this drafter, and why (none is advised)."""
    info = probe_answer(engine, python, Path(target), launch=list(extra))
    info["unavailable_engines"] = dict(unavailable or {})
    if dtype in (None, "auto"):
        from ..compute_dtype import host_device, resolve

        dtype = resolve(None, host_device())
    shape = list(info.get("target_shape_reasons") or [])
    causes = [r for r in info["reasons"] if r not in shape] + engine.serve_refusals(
        Path(target), info, dtype, list(extra)) + [r for r in info["reasons"] if r in shape]
    if not causes:
        return None, info
    said = causes[0] if len(causes) == 1 else (f"{len(causes)} causes, in the order the server would meet them: "
                                               + " ".join(f"({i}) {c};" for i, c in enumerate(causes, 1))[:-1])
    model_type = json.loads((Path(target) / "config.json").read_text()).get("model_type", "?")
    advice = f" {_advice(engine, info, 'serve EAGLE-3', model_type)}" if not info["supported"] else ""
    return (f"{engine.NAME} {info['version']} cannot serve an EAGLE-3 drafter for this target ({target}, "
            f"architecture {info.get('architecture', '?')}, served in {dtype}): {said}.{advice}"), info


def serve_preflight(engine, python: str, target: Path, *, dtype: str | None = None, extra: list[str] = (),
                    unavailable: dict[str, str] | None = None) -> dict:
    """Before an EAGLE-3 server starts: can the installed engine serve a drafter for `target` (its support
    probe, above), and would the server live past loading it (the engine's `serve_refusals`: for vLLM a key of
    the target's config its EAGLE proposer reads, attention backends with no block size in common), judged
    against the target's config.json, the server's `dtype` (None: the one the stages pick on this host) and
    extra_args every time. The one check for every stage or gate about to spend a server start on EAGLE-3
    (serve_bench, engine_check's `serve`); a StageError naming every reason, in order, and what to do."""
    why, info = serve_refusal(engine, python, target, dtype=dtype, extra=extra, unavailable=unavailable)
    if why is not None:
        raise StageError(why)
    return info


def log_tail(path: Path, nbytes: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


_RAISED = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [\d-]+ [\d:]+ \[[^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception): .+)$")


def first_error(path: Path) -> str | None:
    """The first exception a server's log records: the root cause. vLLM's engine process fails first and its
    parents then raise their own errors ("Engine core initialization failed. See root cause above"), so the
    log's tail alone can lose the one line a user needs."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = _RAISED.match(line.rstrip())
                if m:
                    return m.group(1)
    except OSError:
        pass
    return None


def _why(path: Path) -> str:
    cause = first_error(path)
    return (f"; the first error in its log: {cause}" if cause else "") + \
        f"; the end of its log ({path}):\n{log_tail(path)}"


class EngineServer:
    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, env: dict | None = None,
                 health: str = "/health"):
        self.name, self.argv, self.port, self.log_path, self.health = name, argv, port, log_path, health
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> EngineServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True, preexec_fn=_stop_with_parent)
        log.close()
        # The server's own SIGTERM (above) may leave its engine processes behind when it dies mid-start; the
        # watcher, in the worker's group, stops the server's whole group when the worker dies, kill -9 included
        root = str(Path(__file__).resolve().parents[3])  # the directory holding eagle3_assets: importable there
        self.watcher = subprocess.Popen(
            [sys.executable, "-c", "import sys; from eagle3_assets.worker.engines.server import watch; "
             "watch(int(sys.argv[1]))", str(self.proc.pid)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def died(self, wait_s: float = 0.0) -> str | None:
        """Why the server is gone, or None if it still runs. `wait_s` covers the moment after a crash in which
        its sockets are already closed (so requests fail) but the process is not yet reaped."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout=wait_s) if wait_s else None
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is not None:
            return f"{self.name} exited with status {self.proc.returncode}{_why(self.log_path)}"
        return None

    def get(self, route: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("GET", route)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float, reporter=None, since: float | None = None) -> float:
        """Seconds until the health route answered 200, counted from `since` (a time.monotonic() when the server
        was started; default: now); a StageError with the log's tail if the server dies or is not ready in time
        (the server is stopped by __exit__ either way)."""
        t0 = time.monotonic() if since is None else since
        next_note = t0 + 30
        while True:
            if (why := self.died()) is not None:
                raise StageError(f"{self.name} died while starting: {why}")
            try:
                if self.get(self.health, timeout_s=5)[0] == 200:
                    return time.monotonic() - t0
            except (OSError, http.client.HTTPException):
                pass
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise StageError(f"{self.name} was not ready after {timeout_s:g} s (ready_timeout_s)"
                                 f"{_why(self.log_path)}")
            if reporter is not None and now >= next_note:
                next_note = now + 30
                reporter.log(f"waiting for {self.name} to get ready ({now - t0:.0f} s)")
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        proc = self.proc

        def reap_or_sleep():  # the leader is our child: reap it as it exits, or its zombie keeps the group
            if proc.poll() is None:
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
        # start_new_session: the server leads its own group
        _end_group(proc.pid, ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)), reap_or_sleep)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self.proc = None
        if getattr(self, "watcher", None) is not None:  # it exits on its own once the group is gone
            try:
                self.watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.watcher.kill()
                self.watcher.wait()
            self.watcher = None


def watch(pgid: int) -> None:
    """The watcher process's body (argv: the server's process group id), run from the worker's group: when
    the worker dies (its SIGTERM through PR_SET_PDEATHSIG, or a cancel's SIGTERM to the worker's group),
    SIGTERM to the server's group, then SIGKILL after 15 s; returns as soon as the group is gone."""
    import ctypes

    def stop(*_):
        _end_group(pgid, ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)), lambda: time.sleep(0.2))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    while process_group.alive(pgid):
        if os.getppid() != parent:  # the worker died (before the prctl, or where it is unavailable)
            stop()
        time.sleep(0.5)


def _stop_with_parent() -> None:
    """In the server's process, before exec: Linux sends it SIGTERM when the worker that started it dies, by
    any means (kill -9 included), so a server never outlives its stage and keeps a GPU. Elsewhere a no-op:
    the worker's own SIGTERM handler (worker/__main__.py) still stops it on a cancel."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _end_group(pgid: int, steps, pause) -> None:
    """Each (signal, seconds) in turn to the process group, waiting (calling `pause`) until it is gone."""
    for sig, wait in steps:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end and process_group.alive(pgid):
            pause()
        if not process_group.alive(pgid):
            return
