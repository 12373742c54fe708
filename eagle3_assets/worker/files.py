"""Paths under the host work directory, content hashes, and writes that are never seen half-done."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..stages.base import PLAIN_NAME  # a name that becomes one directory under the host work directory
from .errors import StageError


def check_plain_name(name, what: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(PLAIN_NAME, name):
        raise StageError(f"{what} {name!r} is not a plain name: use letters, digits, '-', '_' and single dots between "
                         "them, no '..' and no '/' (it names one directory under the host work directory)")
    return name


def resolve(workdir: str, path: str) -> Path:
    """A stage path: absolute as given, else relative to the host work directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(workdir) / p


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(paths: list[Path]) -> str:
    """One hash over several files (name + content), cached next to each file by (size, mtime) so that
    re-describing a multi-GB model does not re-read it."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(cached_sha256(p).encode())
    return h.hexdigest()


def cached_sha256(path: Path) -> str:
    st = path.stat()
    cache = path.with_name(f".{path.name}.sha256.json")
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return data["sha256"]
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    try:
        cache.write_text(json.dumps({"key": key, "sha256": digest}))
    except OSError:
        pass  # a read-only model directory still works, just without the cache
    return digest


@contextmanager
def atomic_file(path: Path, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it over `path` only if the block finishes. `fsync`: the content
    is on disk before the rename, and the rename after it, so a crash or power loss leaves the old file or the
    whole new one under `path`, never a short one (a file later runs reuse as complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if fsync:
            _sync(tmp)
        os.replace(tmp, path)
        if fsync:
            _sync(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too: fsync on it makes a rename in it durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place, replacing an older one without a moment where neither exists
    complete under `final` (readers key on the manifest inside it)."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def require_file(path: Path, what: str, hint: str) -> Path:
    if not path.exists():
        raise StageError(f"{what} not found at {path}: {hint}")
    return path


def write_json(path: Path, obj, fsync: bool = False) -> None:
    with atomic_file(path, fsync) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))


def quarantine(path: Path) -> Path:
    """Move an unreadable file aside as `<name>.corrupt-<time>` (kept for inspection, never overwritten)."""
    dest = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    os.replace(path, dest)
    return dest
