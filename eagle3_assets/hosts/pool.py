"""A pool of hosts: the `gpu_host` resource when the work spreads over several machines.

The hosts are listed in a YAML file (`EAGLE3_HOSTS`), each a local, SSH or Kubernetes host with its own work
directory.
Which host a run uses is its run tag `eagle3/host`; the run queue keeps one run per tag value
(`tag_concurrency_limits` with `applyLimitPerUniqueValue` in dagster.yaml), so a backfill of N shards over H
hosts runs H at a time. Runs without the tag use the first host, except a shard's: an asset backfill's runs
carry no host tag, and a pool does not guess one the queue cannot see. Every materialization records the host
it ran on (`host` in its metadata); a stage whose inputs another host made gets them copied first, through this
control plane (`bring`, hosts/replicate.py), unless both hosts name the same `storage` (one shared filesystem).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import dagster as dg
import yaml
from pydantic import Field, ValidationError

from ..stages.base import plain_name
from .base import GpuHost, Held, StageRun
from .k8s import K8sHost
from .local import LocalGpuHost
from .replicate import held_copy, listing, replicate
from .ssh import UNREACHABLE, SshGpuHost

HOST_TAG = "eagle3/host"  # the run's host; the run queue limits runs per value of it
HOSTS_ENV = "EAGLE3_HOSTS"
KINDS = {"local": LocalGpuHost, "ssh": SshGpuHost, "k8s": K8sHost}
DATA_VERSION_TAG = "dagster/data_version"
GUIDE = "docs/guides/scale-out.md, 'Several hosts'"


@dataclass(frozen=True)
class Member:
    name: str
    host: GpuHost
    storage: str  # hosts naming the same storage see the same work directory (a shared filesystem)


def _where(path: str) -> str:
    """The hosts file as its errors name it: its path, and the variable that named it when one did."""
    named = os.environ.get(HOSTS_ENV)
    from_env = bool(named) and Path(named).expanduser() == Path(path).expanduser()
    return f"hosts file {path}" + (f" ({HOSTS_ENV})" if from_env else "")


def _load(path: str) -> tuple[Any, list[dict[str, int]]]:
    """The hosts file's YAML, and for each host under `hosts:` the line it begins on ("") and each key's line."""
    where = _where(path)
    try:
        text = Path(path).expanduser().read_text()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file (a YAML file listing the hosts: {GUIDE})") from None
    except OSError as e:
        raise ValueError(f"{where} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    try:
        data, root = yaml.safe_load(text), yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:  # the line and column, never the text there (it may hold a password)
        m, c = e.problem_mark, e.context_mark
        at = f"line {m.line + 1}, column {m.column + 1}" if m else "somewhere"
        context = f" ({e.context}, line {c.line + 1}, column {c.column + 1})" if e.context and c else ""
        raise ValueError(f"{where} is not valid YAML: {at}: {e.problem or e.context}{context}. Fix it there "
                         f"({GUIDE} shows the form)") from None
    except yaml.YAMLError as e:  # a character YAML refuses (ReaderError): where it is
        line = text[: getattr(e, "position", 0)].count("\n") + 1
        raise ValueError(f"{where} is not valid YAML: line {line}: {getattr(e, 'reason', e)}") from None
    lines: list[dict[str, int]] = []
    if isinstance(root, yaml.MappingNode):
        seq = next((v for k, v in root.value if k.value == "hosts"), None)
        for node in seq.value if isinstance(seq, yaml.SequenceNode) else []:
            keys = node.value if isinstance(node, yaml.MappingNode) else []
            lines.append({"": node.start_mark.line + 1,
                          **{str(k.value): k.start_mark.line + 1 for k, _ in keys if isinstance(k, yaml.ScalarNode)}})
    return data, lines


def _checked(path: str) -> tuple[list[dict], Callable[[int, str], str]]:
    """The hosts, checked but their settings unread, and where host i's (from 0) setting `key` is in the file."""
    data, lines = _load(path)
    where = _where(path)

    def at(i: int, key: str = "") -> str:
        ln = lines[i].get(key, lines[i][""]) if i < len(lines) else None
        return f"{where}, line {ln}" if ln else where

    hosts = (data or {}).get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) for h in hosts):
        raise ValueError(f"{where}: expected `hosts:` with a list of hosts, each a mapping with name, kind "
                         f"({' or '.join(KINDS)}) and workdir")
    names = [str(h.get("name", "")) for h in hosts]
    for i, n in enumerate(names):
        try:
            plain_name(n)
        except ValueError as e:
            raise ValueError(f"{at(i, 'name')}: host {i + 1}: name {e}") from None
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ValueError(f"{where}: host names must differ; {doubled} appear more than once")
    for i, h in enumerate(hosts):
        if h.get("kind") not in KINDS:
            raise ValueError(f"{at(i, 'kind')}: host {h['name']!r}: kind {h.get('kind')!r} is not one of "
                             f"{sorted(KINDS)}")
        odd = [k for k in h if not isinstance(k, str)]
        if odd:
            raise ValueError(f"{at(i)}: host {h['name']!r}: {odd[0]!r} is not a setting's name")
    return hosts, at
def host_names(path: str) -> list[str]:
    """The pool's host names in order (the first is where unpartitioned work runs), checked, secrets unread."""
    return [h["name"] for h in _checked(path)[0]]


def _resolve(where: str, name: str, key: str, value: Any) -> Any:
    """`{env: VAR}` -> the variable's value, read when a run starts: secrets stay out of the file and the UI."""
    if isinstance(value, dict) and set(value) == {"env"}:
        var = value["env"]
        if not isinstance(var, str) or not var:
            raise ValueError(f"{where}: host {name!r}: {key}: {{env: ...}} takes the name of an environment "
                             f"variable, not a {type(var).__name__}")
        if var not in os.environ:
            raise ValueError(f"{where}: host {name!r}: {key} is read from ${var}, which is not set: set it in the "
                             "environment Dagster runs in")
        return os.environ[var]
    return value


def _members(path: str) -> list[Member]:
    out = []
    hosts, at = _checked(path)
    for i, h in enumerate(hosts):
        fields = {k: _resolve(at(i, k), h["name"], k, v) for k, v in h.items() if k not in ("name", "kind", "storage")}
        try:
            host = KINDS[h["kind"]](**fields)
        except ValidationError as e:
            errors = e.errors()
            bad = "; ".join(f"{'.'.join(map(str, x['loc'])) + ': ' if x['loc'] else ''}{x['msg']}" for x in errors)
            first = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else ""
            raise ValueError(f"{at(i, first)}: host {h['name']!r} ({h['kind']}): {bad}") from None
        out.append(Member(h["name"], host, str(h.get("storage") or h["name"])))
    return out


@lru_cache(maxsize=8)
def _cached_members(path: str, mtime_ns: int, env_key: tuple) -> tuple[Member, ...]:
    return tuple(_members(path))


def home_host(names: list[str], partition_key: str) -> str:
    """The host a shard partition is launched on: shard i on host i mod H (spread evenly, the same every time)."""
    i = int(partition_key) if partition_key.isdigit() else zlib.crc32(partition_key.encode())
    return names[i % len(names)]


class HostPool(GpuHost):
    """Several hosts, one of them per run: the one its `eagle3/host` tag names, else the first."""

    hosts_file: str = Field(description="YAML file listing the hosts (name, kind: local | ssh | k8s, storage, and the "
                                        "host's own settings; secrets as {env: VAR})")
    workdir: str = Field(default="", description="unused: each host has its own")

    # ---- members ----------------------------------------------------------------------------------------
    def members(self) -> dict[str, Member]:
        p = Path(self.hosts_file).expanduser()
        try:
            mtime = p.stat().st_mtime_ns
        except OSError:
            _load(self.hosts_file)  # says what is wrong with the file, naming it
            raise
        ms = _cached_members(str(p), mtime, tuple(sorted(os.environ.items())))
        return {m.name: m for m in ms}

    @property
    def primary(self) -> Member:
        return next(iter(self.members().values()))

    def host_name(self, context) -> str:
        members = self.members()
        tag = context.run.tags.get(HOST_TAG)
        if tag:
            if tag not in members:
                raise dg.Failure(description=f"the run's {HOST_TAG} tag names host {tag!r}, which is not in "
                                             f"{self.hosts_file} (hosts: {', '.join(members)})", allow_retries=False)
            return tag
        spread = context.has_partition_key and isinstance(
            getattr(context.assets_def, "partitions_def", None), dg.DynamicPartitionsDefinition)
        if spread and len(members) > 1:
            raise dg.Failure(description=(
                f"this shard's run has no {HOST_TAG} tag, so the run queue cannot keep it to one job per host. Launch "
                "the shards from the extract_hidden_states job, whose runs are tagged with their host (UI: Jobs > "
                "extract_hidden_states > Partitions > Launch backfill; CLI: dagster job backfill -j "
                "extract_hidden_states --all), or add the tag to this run (one of: " + ", ".join(members) + ")"),
                allow_retries=False)
        return self.primary.name

    def member(self, context) -> Member:
        return self.members()[self.host_name(context)]

    def _warn_if_pool_limits(self, context) -> None:
        try:
            slots = context.instance.event_log_storage.get_concurrency_info("gpu_host").slot_count
        except Exception:  # no pool limit stored (a bare instance): nothing to warn about
            return
        if slots is not None and 0 < slots < len(self.members()):
            context.log.warning(f"the gpu_host concurrency pool allows {slots} step(s) at once for "
                                f"{len(self.members())} hosts: only {slots} host(s) can work at a time "
                                f"(dagster instance concurrency set gpu_host {len(self.members())})")

    # ---- stages -----------------------------------------------------------------------------------------
    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        m = self.member(context)
        self._warn_if_pool_limits(context)
        context.log.info(f"running {stage} on host {m.name!r} of {len(self.members())}")
        try:
            run = m.host.run_stage(context, stage, args)
        except dg.Failure as e:
            raise _on_host(m.name, e) from None
        run.host = m.name
        return run

    def check(self, context, gpus: bool, need_bytes: int | None = None) -> dict[str, Any]:
        m = self.member(context)
        try:
            # each host says whether it must have GPUs (a pool may mix GPU hosts with a CPU one)
            info = m.host.check(context, gpus=gpus or m.host.require_gpus, need_bytes=need_bytes)
        except dg.Failure as e:
            raise _on_host(m.name, e) from None
        return {**info, "host": m.name}

    @contextmanager
    def files(self) -> Iterator[tuple[Any, str]]:
        with self.primary.host.files() as f:
            yield f

    def put_file(self, local_path: str, rel_path: str) -> None:
        self.primary.host.put_file(local_path, rel_path)

    def get_file(self, rel_path: str, local_path: str) -> None:
        self.primary.host.get_file(rel_path, local_path)

    # ---- where artifacts are ----------------------------------------------------------------------------
    def locate(self, instance: dg.DagsterInstance, item: Held) -> tuple[str, str]:
        """(host that made it, its data version), from the upstream asset's latest materialization."""
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(item.asset),
                                  asset_partitions=[item.partition] if item.partition else None), limit=1).records
        if not records:
            raise dg.Failure(description=f"{item.asset}{'@' + item.partition if item.partition else ''} was never "
                                         f"materialized: materialize it first", allow_retries=False)
        mat = records[0].event_log_entry.asset_materialization
        holder = mat.metadata["host"].value if "host" in mat.metadata else self.primary.name
        if holder not in self.members():
            raise dg.Failure(description=f"{item.asset} was made on host {holder!r}, which is no longer in "
                                         f"{self.hosts_file}: add it back, or materialize {item.asset} again",
                             allow_retries=False)
        return holder, mat.tags.get(DATA_VERSION_TAG) or records[0].run_id

    def bring(self, context, held: list[Held]) -> dict[str, str]:
        here = self.member(context)
        out = {}
        with ExitStack() as stack:
            opened: dict[str, tuple] = {}

            def fs(name: str) -> tuple:
                if name not in opened:
                    try:
                        opened[name] = stack.enter_context(self.members()[name].host.files())
                    except dg.Failure as e:
                        raise _on_host(name, e) from None
                return opened[name]

            for item in held:
                holder, version = self.locate(context.instance, item)
                if holder == here.name or self.members()[holder].storage == here.storage:
                    out[item.path] = item.path
                    continue
                dst = fs(here.name)
                if not item.path.startswith("/"):  # a copy of this version already here: the holder may be down
                    copy = held_copy(dst[0], dst[1], item.path)
                    if copy and copy.get("version") == version:
                        out[item.path] = item.path
                        continue
                src = fs(holder)
                rel = _relative(item.path, src[1])
                if rel is None:  # outside the work directory (a target at /models/...): each host has its own
                    _same_files(item, holder, src, here.name, dst)
                    out[item.path] = item.path
                    continue
                replicate(src, dst, rel, version, holder, context.log.info)
                out[item.path] = f"{dst[1]}/{rel}" if item.path.startswith("/") else rel
        return out

    def reachable(self, instance: dg.DagsterInstance, name: str, held: list[Held]) -> str | None:
        """None when host `name` answers and can have every input (holds it, shares its storage, or the host
        that holds it answers); else why not."""
        with ExitStack() as stack:
            try:
                dst = stack.enter_context(self.members()[name].host.files())
            except dg.Failure as e:
                return f"host {name!r} does not answer: {e.description}"
            for item in held:
                holder, version = self.locate(instance, item)
                if holder == name or self.members()[holder].storage == self.members()[name].storage:
                    continue
                if not item.path.startswith("/"):
                    copy = held_copy(dst[0], dst[1], item.path)
                    if copy and copy.get("version") == version:
                        continue
                try:
                    stack.enter_context(self.members()[holder].host.files())
                except dg.Failure:
                    return f"{item.asset} is on host {holder!r}, which does not answer, and {name!r} has no copy"
        return None


def _relative(path: str, root: str) -> str | None:
    if not path.startswith("/"):
        return path
    return path[len(root) + 1:] if path.startswith(root.rstrip("/") + "/") else None


def _same_files(item: Held, holder: str, src: tuple, here: str, dst: tuple) -> None:
    """An input outside the work directory must be there on this host too, the same files at the same sizes."""
    theirs = listing(src[0], item.path)
    try:
        mine = listing(dst[0], item.path)
    except FileNotFoundError:
        mine = {}
    if mine != theirs:
        differ = sorted(set(theirs) ^ set(mine) | {f for f in theirs if f in mine and theirs[f] != mine[f]})
        raise dg.Failure(description=f"host {here!r} does not have {item.path} as host {holder!r} has it "
                                     f"({item.asset}; differing: {', '.join(differ[:5]) or 'missing'}): put the same "
                                     f"files there, or keep this work on {holder!r}", allow_retries=False)


def _on_host(name: str, e: dg.Failure) -> dg.Failure:
    meta = {k: v for k, v in (e.metadata or {}).items()}
    return dg.Failure(description=f"host {name!r}: {e.description}", metadata={**meta, "host": name},
                      allow_retries=e.allow_retries)


def unreachable(metadata: dict) -> bool:
    v = metadata.get(UNREACHABLE)
    return bool(getattr(v, "value", v))
