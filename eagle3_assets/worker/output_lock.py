"""One worker per output. Stages clear what a dead run left next to their output (temporary shards, stale
checkpoints), so two workers writing the same output delete each other's files. A stage holds an exclusive
lock on its output for its whole life: the kernel drops it when the process ends, however it ends, so a
lock can never be left stale; the file names the holder, so a refusal can say which process to wait for."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import StageError
from .files import resolve

WAIT_ENV = "EAGLE3_OUTPUT_LOCK_WAIT_S"  # how long a second worker waits for the first before refusing
DEFAULT_WAIT_S = 60.0


def output_of(workdir: str, args) -> Path | None:
    """The file or directory a stage writes, from its arguments (a stage's Args: `out`, or `out_dir` and a
    `shard` in it); None for a stage that writes nothing."""
    out, out_dir, shard = (getattr(args, k, None) for k in ("out", "out_dir", "shard"))
    if out:
        return resolve(workdir, str(out))
    if out_dir:
        return resolve(workdir, str(out_dir)) / (f"shard-{int(shard):05d}" if shard is not None else "")
    return None


@contextmanager
def hold(workdir: str, stage: str, args, log=None) -> Iterator[None]:
    out = output_of(workdir, args)
    if out is None:
        yield
        return
    locks = Path(workdir) / ".eagle3" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", out.name)[:40]
    path = locks / f"{slug}-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited: a server the stage starts holds nothing
    try:
        wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(path)
                if time.monotonic() >= deadline:
                    raise StageError(
                        f"another {holder.get('stage', 'worker')} worker (pid {holder.get('pid', '?')}, started "
                        f"{_ago(holder)}) is writing {out}; a second one would delete its files. Wait for it to "
                        f"end, or stop it (kill {holder.get('pid', 'PID')}), then run again") from None
                if log is not None and not told:
                    log(f"waiting up to {wait_s:g} s for pid {holder.get('pid', '?')} ({holder.get('stage')}) to "
                        f"finish writing {out}")
                    told = True
                time.sleep(0.2)
        me = {"pid": os.getpid(), "stage": stage, "out": str(out), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a waiting worker)


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _ago(holder: dict) -> str:
    since = holder.get("since")
    return f"{time.time() - since:.0f} s ago" if since else "at an unknown time"
