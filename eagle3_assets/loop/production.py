"""Which drafter is in production, per engine: the `production_drafter` asset's materializations are the record.
Each decision (promoted by the gate, promoted by hand, rolled back) is one materialization of the engine's partition,
written once in one transaction of Dagster's event log (a control plane killed mid-decision leaves the record as it
was, or with the whole decision), holding the export served, the checkpoint, the champion it replaced, both drafters'
gate figures and the traffic days behind the challenger. The newest is production; the ones before it are what a
rollback returns to. Decisions made by hand are serialized by a file lock beside the instance (`decision_lock`), so
that each names the one it replaced. What the servers actually serve (after a failed or partial rollout: not always
the record's) is `on_servers`."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from ..eye import served
from ..eye.servers_file import Server

PRODUCTION = dg.AssetKey("production_drafter")
EXPORT = served.EXPORT


def history(instance: dg.DagsterInstance, engine: str, limit: int = 200) -> list[dict]:
    """The engine's decisions, newest first: {storage_id, when, run_id, **metadata}."""
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=PRODUCTION, asset_partitions=[engine]),
                                           limit=limit).records
    return [{"storage_id": r.storage_id, "when": r.timestamp, "run_id": r.run_id, **served.meta(r)} for r in recs]


@contextmanager
def decision_lock(instance: dg.DagsterInstance) -> Iterator[None]:
    """One decision at a time on this instance, from reading production to recording the new one: two at once would
    both read the same champion (both `replaced none`). flock: released by the kernel if the process dies."""
    with open(Path(instance.root_directory) / "production.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def current(instance: dg.DagsterInstance, engine: str) -> dict | None:
    found = history(instance, engine, limit=1)
    return found[0] if found else None


def export_of(instance: dg.DagsterInstance, version: str | None = None, asset: dg.AssetKey = EXPORT) -> dict:
    """An export (of `asset`: drafter_export or challenger_export) by the checkpoint it was made from (a prefix of its
    data version, at least 8 characters), else the newest: {checkpoint, source, <dialect>_path, ...}."""
    if version is not None and len(version) < 8:
        raise ValueError(f"version {version!r}: give at least 8 characters of the checkpoint (its data version)")
    for rec in instance.fetch_materializations(asset, limit=served.SCAN).records:
        ckpt = (rec.event_log_entry.asset_materialization.tags or {}).get(served.INPUT_VERSION + "eagle3_drafter") \
            or (rec.event_log_entry.asset_materialization.tags or {}).get(served.INPUT_VERSION + "challenger_drafter")
        if version is None or (ckpt or "").startswith(version):
            return {"checkpoint": ckpt, "storage_id": rec.storage_id, **served.meta(rec)}
    what = f"no {asset.to_user_string()} of checkpoint {version}" if version else f"no {asset.to_user_string()} yet"
    raise ValueError(f"{what}: `eagle3-assets lineage` lists the checkpoints benchmarked; materialize the export first")


def decision(engine: str, export: dict, how: str, why: str, before: dict | None, **extra) -> dict:
    """The metadata of one decision: what is served from now on, and what it replaced."""
    path = export.get(f"{engine}_path")
    if not path:
        raise ValueError(f"the export of checkpoint {export.get('checkpoint')} has no {engine} dialect "
                         f"({export.get(f'{engine}_left_out') or 'export it for ' + engine})")
    return {"engine": engine, "version": export["checkpoint"] or "unknown", "export_path": str(path),
            "trained_path": str(export.get("source") or ""), "decision": how, "why": why,
            "replaced": (before or {}).get("version") or "none", "replaced_export_path": (before or {}).get("export_path") or "",
            **extra}


def report(instance: dg.DagsterInstance, engine: str, meta: dict) -> None:
    """A decision made outside a run (the CLI): one runless materialization of the engine's partition."""
    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset_key=PRODUCTION, partition=engine, metadata=meta,
        tags={"dagster/data_version": meta["version"]}))


def rollback_target(instance: dg.DagsterInstance, engine: str, version: str | None) -> dict:
    """The export a rollback returns to: `version`, else the production drafter before the current one."""
    past = history(instance, engine)
    if not past:
        raise ValueError(f"nothing is in production on {engine} yet: promote a drafter first")
    if version is None:
        older = [h for h in past[1:] if h["version"] != past[0]["version"]]
        if not older:
            raise ValueError(f"{engine} has had only {past[0]['version'][:12]} in production: nothing to roll back to")
        version = older[0]["version"]
    for h in past:
        if h["version"].startswith(version):
            return {"checkpoint": h["version"], f"{engine}_path": h["export_path"], "source": h["trained_path"]}
    raise ValueError(f"{version} was never in production on {engine}: `eagle3-assets production` lists what was")


def on_servers(instance: dg.DagsterInstance, engine: str, servers: list[Server]) -> dict[str, dict]:
    """What each server of the engine serves, as far as this instance knows: {name: {drafter, how}}, from the newest
    of what a rollout left on it (and how it went) and what the server itself said in a live observation; else the
    servers file's word. Servers a rollout named but the file no longer lists are kept."""
    out: dict[str, dict] = {}
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=served.ROLLOUT, asset_partitions=[engine]),
                                           limit=20).records
    for rec in recs:  # newest first: the newest rollout that touched a server says what it left there
        for name, got in (served.meta(rec).get("servers") or {}).items():
            out.setdefault(name, {"drafter": got.get("drafter"), "how": f"rollout: {got.get('status')}",
                                  "t": rec.timestamp})
    for s in servers:
        if s.engine != engine:
            continue
        told = [o for o in served.observations(instance, s.name, limit=50) if o.get("drafter_from") == "server"]
        if told and told[-1]["t"] > out.get(s.name, {}).get("t", 0):
            out[s.name] = {"drafter": told[-1]["drafter"], "how": "it says so (live observation)", "t": told[-1]["t"]}
        out.setdefault(s.name, {"drafter": s.drafter, "how": "the servers file: no rollout has touched it", "t": 0})
    return out
