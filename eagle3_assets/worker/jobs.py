"""Detached jobs on the GPU host: `python -m eagle3_assets.worker.jobs launch|status|stop RUNDIR ...`.

The SSH host starts every stage through this. `launch` forks a supervisor into its own session (so a
dropped SSH connection does not end it); the supervisor runs the worker with its output in RUNDIR/log,
records the pids (state.json) and, when the worker ends, how it ended (exit.json). Each command answers
one JSON line. Standard library only: it starts in milliseconds and never waits on a stage's imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

SPEC, STATE, EXIT, LOG, MESSAGES, ARGS = "job.json", "state.json", "exit.json", "log", "messages.jsonl", "args.json"


def _path(rundir: str, name: str) -> str:
    return os.path.join(rundir, name)


def sources_fingerprint(paths: list[str], cwd: str | None) -> str | None:
    """What the host files a job reads without an upstream version look like now: every file's path, size and
    modification time under each path (a directory is walked, hidden files aside: the stages keep their weight
    hashes there as `.NAME.sha256.json`). None when the job names none."""
    if not paths:
        return None
    import hashlib

    seen = []
    for p in paths:
        root = os.path.join(cwd or "", os.path.expanduser(p))
        if os.path.isdir(root):
            for d, dirs, files in os.walk(root):
                dirs[:] = sorted(x for x in dirs if not x.startswith("."))
                for name in sorted(x for x in files if not x.startswith(".")):  # not our hash sidecars
                    st = os.stat(os.path.join(d, name))
                    seen.append([os.path.relpath(os.path.join(d, name), root), st.st_size, st.st_mtime_ns])
        elif os.path.exists(root):
            st = os.stat(root)
            seen.append([p, st.st_size, st.st_mtime_ns])
        else:
            seen.append([p, "missing"])
    return hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:16]


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _write_json(path: str, obj) -> None:
    """Complete or absent, and readable by the owner only: a job's files name its arguments and environment."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _proc_start(pid: int):
    """The kernel's start time of `pid` (clock ticks since boot), to tell our process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])  # a zombie has ended
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, started) -> bool:
    if os.path.isdir("/proc"):
        return started is not None and _proc_start(pid) == started
    try:  # no /proc (macOS): signal 0 is the best we have
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status(rundir: str) -> dict:
    """missing | starting | running | exited (with returncode/signal) | vanished (ended, no exit status)."""
    state = _read_json(_path(rundir, STATE))
    if state is None:
        return {"state": "missing" if not os.path.isdir(rundir) else "starting"}
    ended = _read_json(_path(rundir, EXIT))
    if ended is not None:
        return {"state": "exited", **state, **ended}
    if _alive(state["supervisor_pid"], state.get("supervisor_start")):
        return {"state": "running", **state}
    return {"state": "vanished", **state}


def launch(rundir: str, spec_file: str) -> dict:
    """Start the job described by `spec_file` in `rundir`, unless that job is already there: a running
    job (this run's or a retry's) is attached to, never started twice, and refused if it reads other
    inputs; a finished one is reused only if it succeeded, for the same attach key, the same inputs and the
    host sources it names (`sources`: a target directory given by path) unchanged since it started.
    Any other earlier attempt is kept as RUNDIR.attempt-N."""
    with open(spec_file) as f:
        spec = json.load(f)
    current = status(rundir)
    old_spec = _read_json(_path(rundir, SPEC)) or {}
    same_inputs = old_spec.get("inputs") == spec.get("inputs")
    spec["sources_fingerprint"] = sources_fingerprint(spec.get("sources") or [], spec.get("cwd"))
    same_sources = old_spec.get("sources_fingerprint") == spec["sources_fingerprint"]
    if current["state"] in ("running", "starting") and not same_inputs and "inputs" in old_spec:
        os.remove(spec_file)
        return {"action": "refused", **current,
                "reason": f"the job in {rundir} (pid {current.get('worker_pid')}) still runs on inputs that have "
                          "changed since it started; a second one would write the same files. Wait for it to end, "
                          f"or stop it (python -m eagle3_assets.worker.jobs stop '{rundir}'), then run again"}
    if current["state"] in ("running", "starting") or (
            current["state"] == "exited" and current.get("returncode") == 0 and same_inputs and same_sources
            and old_spec.get("attach_key") == spec.get("attach_key")):
        os.remove(spec_file)
        return {"action": "attached", **current}
    if os.path.exists(rundir):
        n = 1
        while os.path.exists(f"{rundir}.attempt-{n}"):
            n += 1
        os.rename(rundir, f"{rundir}.attempt-{n}")
    os.makedirs(rundir)
    if "args" in spec:  # the stage's arguments: in an owner-only file the worker reads (--args-file), never in argv
        _write_json(_path(rundir, ARGS), spec.pop("args"))
        spec["argv"] = [_path(rundir, ARGS) if a == ARGS else a for a in spec["argv"]]
    _write_json(_path(rundir, SPEC), spec)  # with the sources' fingerprint as they are now, at the start
    os.remove(spec_file)
    pid = os.fork()
    if pid == 0:  # the supervisor: new session, stdio off the SSH channel
        code = 1
        try:
            os.setsid()
            fd = os.open(_path(rundir, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = _supervise(rundir)
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        current = status(rundir)
        if current["state"] != "starting":
            return {"action": "started", **current}
        time.sleep(0.01)
    raise SystemExit(f"the supervisor in {rundir} did not start within 30 s; see {_path(rundir, LOG)}")


def _supervise(rundir: str) -> int:
    spec = _read_json(_path(rundir, SPEC))
    # the environment may hold tokens: keep only its names on disk once it is read
    _write_json(_path(rundir, SPEC), {**spec, "env": sorted(spec.get("env", {}))})
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # SIGTERM reaches the whole group (see stop); the supervisor outlives it to record the worker's end.
    signal.signal(signal.SIGTERM, lambda *_: None)
    env = {**os.environ, **spec.get("env", {})}
    try:
        proc = subprocess.Popen(spec["argv"], cwd=spec.get("cwd") or None, env=env, stdin=subprocess.DEVNULL,
                                stdout=1, stderr=2, restore_signals=True)
    except OSError as e:
        _write_json(_path(rundir, STATE), _state(None))
        _write_json(_path(rundir, EXIT), {"returncode": 127, "signal": None, "error": f"cannot start: {e}",
                                          "finished": time.time()})
        return 1
    _write_json(_path(rundir, STATE), _state(proc.pid))
    rc = proc.wait()
    sig = -rc if rc < 0 else None
    _write_json(_path(rundir, EXIT), {"returncode": rc, "signal": sig,
                                      "signal_name": signal.Signals(sig).name if sig else None,
                                      "finished": time.time()})
    return 0


def _state(worker_pid) -> dict:
    me = os.getpid()
    return {"supervisor_pid": me, "supervisor_start": _proc_start(me), "pgid": os.getpgid(0),
            "worker_pid": worker_pid, "started": time.time(), "hostname": os.uname().nodename}


def stop(rundir: str, grace_s: float) -> dict:
    """SIGTERM to the job's process group, SIGKILL after `grace_s`; records the stop if nothing else did."""
    current = status(rundir)
    if current["state"] != "running":
        return {"stopped": False, **current}
    pgid = current["pgid"]
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and status(rundir)["state"] == "running":
            time.sleep(0.1)
        if status(rundir)["state"] == "running":
            os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if _read_json(_path(rundir, EXIT)) is None:
        _write_json(_path(rundir, EXIT), {"returncode": -9, "signal": 9, "signal_name": "SIGKILL",
                                          "stopped": True, "finished": time.time()})
    return {"stopped": True, **status(rundir)}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("launch", "status", "stop"):
        print("usage: python -m eagle3_assets.worker.jobs launch RUNDIR SPEC | status RUNDIR | stop RUNDIR [GRACE_S]",
              file=sys.stderr)
        return 2
    cmd, rundir = argv[0], argv[1]
    if cmd == "launch":
        out = launch(rundir, argv[2])
    elif cmd == "status":
        out = status(rundir)
    else:
        out = stop(rundir, float(argv[2]) if len(argv) > 2 else 10.0)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
