"""Copying an artifact from the host that made it to the host a stage runs on, through this control plane:
each host's files through fsspec (SFTP for an SSH host), streamed, never held whole in memory.

A copy is written under a temporary name beside its final path and renamed into place, then a marker
(`.<name>.replica.json`) records the version it is a copy of: a copy is complete or absent, and the next stage
that needs the same version finds it and copies nothing. Shards carry their own sha256 per file, which the
train stage checks before it reads a byte; SSH's MAC covers the bytes in transit."""

from __future__ import annotations

import json
import posixpath
import time
import uuid
from collections.abc import Callable

CHUNK = 8 << 20


def _marker(root: str, rel: str) -> str:
    parent, name = posixpath.split(rel)
    return posixpath.join(root, parent, f".{name}.replica.json")


def _read_json(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, OSError, ValueError):
        return None


def held_copy(fs, root: str, rel: str) -> dict | None:
    """What the marker of a copy at `rel` says (version, source host), when the copy is there."""
    marker = _read_json(fs, _marker(root, rel))
    return marker if marker and fs.exists(posixpath.join(root, rel)) else None


def listing(fs, path: str) -> dict[str, int]:
    """Every file under `path` (or `path` itself) by its path relative to it, with its size; hidden files aside
    (the stages' hash sidecars, our markers)."""
    if not fs.isdir(path):
        return {"": fs.size(path)}
    out = {}
    for full, info in fs.find(path, detail=True).items():
        rel = posixpath.relpath(full, path)
        if info.get("type") != "directory" and not any(p.startswith(".") for p in rel.split("/")):
            out[rel] = int(info["size"])
    return out


def _copy_file(src_fs, src: str, dst_fs, dst: str, done: Callable[[int], None]) -> None:
    with src_fs.open(src, "rb") as r, dst_fs.open(dst, "wb") as w:
        if hasattr(r, "prefetch"):  # paramiko: read ahead instead of one round trip per request
            r.prefetch()
        if hasattr(w, "set_pipelined"):
            w.set_pipelined(True)
        while chunk := r.read(CHUNK):
            w.write(chunk)
            done(len(chunk))


def replicate(src: tuple, dst: tuple, rel: str, version: str, source_name: str, log: Callable[[str], None]) -> bool:
    """Copy `rel` (a file or a directory under the work directory) from `src` to `dst`, each `(fs, workdir)`,
    unless `dst` already holds a copy of this `version`. True when it copied."""
    (sfs, sroot), (dfs, droot) = src, dst
    have = held_copy(dfs, droot, rel)
    if have and have.get("version") == version:
        return False
    source, final = posixpath.join(sroot, rel), posixpath.join(droot, rel)
    files = listing(sfs, source)
    total = sum(files.values())
    parent, name = posixpath.split(final)
    dfs.makedirs(parent, exist_ok=True)
    tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex[:8]}-{name}")
    t0, moved, next_log = time.monotonic(), [0], [time.monotonic() + 5.0]

    def done(n: int) -> None:
        moved[0] += n
        if time.monotonic() >= next_log[0]:
            next_log[0] = time.monotonic() + 5.0
            rate = moved[0] / max(time.monotonic() - t0, 1e-6) / 1e6
            log(f"copying {rel} from {source_name}: {moved[0] / 1e6:,.0f}/{total / 1e6:,.0f} MB ({rate:,.0f} MB/s)")

    try:
        for f in sorted(files):
            target = tmp if f == "" else posixpath.join(tmp, f)
            dfs.makedirs(posixpath.dirname(target), exist_ok=True)
            _copy_file(sfs, source if f == "" else posixpath.join(source, f), dfs, target, done)
        got = listing(dfs, tmp)
        if got != files:
            raise OSError(f"the copy of {rel} has {len(got)} files / {sum(got.values()):,} bytes where {source_name} "
                          f"has {len(files)} / {total:,}")
        old = None
        if dfs.exists(final):  # an older version: set aside until the new one is in place
            old = posixpath.join(parent, f".old-{uuid.uuid4().hex[:8]}-{name}")
            dfs.mv(final, old)
        dfs.mv(tmp, final)
        with dfs.open(_marker(droot, rel), "wb") as m:
            m.write(json.dumps({"version": version, "from": source_name, "bytes": total}).encode())
        if old:
            dfs.rm(old, recursive=True)
    except BaseException:
        if dfs.exists(tmp):
            dfs.rm(tmp, recursive=True)
        raise
    s = time.monotonic() - t0
    log(f"copied {rel} from {source_name}: {len(files)} files, {total / 1e6:,.1f} MB in {s:.1f} s "
        f"({total / 1e6 / max(s, 1e-6):,.0f} MB/s)")
    return True
