"""Which checkpoint produced a benchmark result, and what it was trained on: Dagster's provenance walked
back. Every materialization records, per upstream asset, the data version it consumed and the storage id
of that upstream materialization (`dagster/input_event_pointer/<asset>`); following those ids from a
benchmark reaches the exact drafter, vocab, shards, conversations, prompts and target behind it, and the
code version each was made with (`dagster/code_version`, a hash of the code it ran: code_versions.py)."""

from __future__ import annotations

import json
from typing import Any

import dagster as dg

BENCHMARK = dg.AssetKey("serving_benchmark")
POINTER = "dagster/input_event_pointer/"
CODE_VERSION = "dagster/code_version"  # the asset's code_version when it ran (code_versions.py), per materialization
# The chain a benchmark row carries, downstream first.
CHAIN = ["drafter_export", "eagle3_drafter", "vocab_mapping", "hidden_state_shards", "conversations",
         "synthetic_prompts", "prompts", "target_model"]
# Whose code versions a row carries: the benchmark's own code, then the chain's.
CODED = ["serving_benchmark"] + CHAIN


def record(instance: dg.DagsterInstance, asset: str, storage_id: int):
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey.from_user_string(asset),
                                                                 storage_ids=[storage_id]), limit=1).records
    return recs[0] if recs else None


def _op_config(instance: dg.DagsterInstance, run_id: str, asset: str) -> dict:
    run = instance.get_run_by_id(run_id)
    return ((run.run_config or {}).get("ops", {}).get(asset) or {}).get("config", {}) if run else {}


def chain(instance: dg.DagsterInstance, start) -> dict[str, dict[str, Any]]:
    """asset -> {data_version, code_version, partition, run_id, timestamp, config} for the materialization
    `start` and everything upstream of it, as consumed (not as the assets are now)."""
    out: dict[str, dict[str, Any]] = {}
    todo = [start]
    while todo:
        rec = todo.pop()
        mat = rec.event_log_entry.asset_materialization
        name = mat.asset_key.to_user_string()
        if name in out:
            continue
        tags = mat.tags or {}  # None on an event reported from outside a run without tags
        out[name] = {"data_version": tags.get("dagster/data_version"), "code_version": tags.get(CODE_VERSION),
                     "partition": mat.partition, "run_id": rec.run_id, "timestamp": rec.timestamp,
                     "config": _op_config(instance, rec.run_id, name)}
        for key, value in tags.items():
            # "NULL": an upstream never materialized when this one ran (a gate skipped, say): nothing to follow
            if key.startswith(POINTER) and str(value).isdigit() and \
                    (up := record(instance, key[len(POINTER):], int(value))) is not None:
                todo.append(up)
    return out


def benchmark_records(instance: dg.DagsterInstance, limit: int = 10_000) -> list:
    """Every serving_benchmark materialization, oldest first."""
    return list(reversed(instance.fetch_materializations(BENCHMARK, limit=limit).records))


def benchmark_records_between(instance: dg.DagsterInstance, after: int | None = None, before: int | None = None,
                              ascending: bool = True, page: int = 1000):
    """The serving_benchmark materializations with storage ids strictly between `after` and `before`, oldest
    first (or newest first), read a page at a time as they are consumed."""
    where = dg.AssetRecordsFilter(asset_key=BENCHMARK, after_storage_id=after, before_storage_id=before)
    cursor = None
    while True:
        got = instance.fetch_materializations(where, limit=page, cursor=cursor, ascending=ascending)
        yield from got.records
        if not got.has_more:
            return
        cursor = got.cursor


def engine_of(rec) -> str | None:
    """The engine a benchmark record measured (its metadata, else its partition), without walking lineage."""
    mat = rec.event_log_entry.asset_materialization
    return mat.metadata["engine"].value if "engine" in mat.metadata else mat.partition


def settings_of(instance: dg.DagsterInstance, rec) -> str:
    """The benchmark settings a result was measured with (its run's serving_benchmark config), as JSON."""
    return json.dumps(_op_config(instance, rec.run_id, BENCHMARK.to_user_string()), sort_keys=True)


def history_row(instance: dg.DagsterInstance, rec) -> dict[str, Any]:
    """One benchmark result with the lineage behind it: what a user compares, and what changed."""
    mat = rec.event_log_entry.asset_materialization
    meta = {k: v.value for k, v in mat.metadata.items()}
    up = chain(instance, rec)
    row = {
        "when": rec.timestamp, "run_id": rec.run_id, "storage_id": rec.storage_id,
        "engine": engine_of(rec), "engine_version": meta.get("engine_version"),
        "num_speculative_tokens": meta.get("num_speculative_tokens"), "prompt_set": meta.get("prompt_set"),
        "max_new_tokens": meta.get("max_new_tokens"),
        "settings": json.dumps(up.get("serving_benchmark", {}).get("config", {}), sort_keys=True),  # = settings_of
        "acceptance_length": meta.get("acceptance_length"),
        "acceptance_per_pos": json.dumps(meta.get("acceptance_per_pos")),
        "speedup": meta.get("speedup"),
        "checkpoint": meta.get("checkpoint") or up.get("eagle3_drafter", {}).get("data_version"),
        "training_config": json.dumps(up.get("eagle3_drafter", {}).get("config", {}), sort_keys=True),
        # the settings the synthetic prompts were written with, as the run set them ({}: all defaults, or no
        # synthetic_prompts run before it; synthetic_prompts_version and its metadata say how many)
        "synthetic_prompts_config": json.dumps(up.get("synthetic_prompts", {}).get("config", {}), sort_keys=True),
    }
    for asset in CHAIN:
        row[f"{asset}_version"] = up.get(asset, {}).get("data_version")
    for asset in CODED:
        row[f"{asset}_code_version"] = up.get(asset, {}).get("code_version")
    return row


def history(instance: dg.DagsterInstance) -> list[dict[str, Any]]:
    return [history_row(instance, r) for r in benchmark_records(instance)]


def differences(old: dict, new: dict) -> list[str]:
    """What differs between the lineages of two history rows, in the order a user would look."""
    out = []
    if old["checkpoint"] != new["checkpoint"]:
        out.append(f"new checkpoint: {str(old['checkpoint'])[:12]} -> {str(new['checkpoint'])[:12]}")
        if old["training_config"] != new["training_config"]:
            out.append(f"training config changed: {old['training_config']} -> {new['training_config']}")
        if old.get("synthetic_prompts_config") != new.get("synthetic_prompts_config"):
            out.append(f"synthetic prompts' settings changed: {old.get('synthetic_prompts_config')} -> "
                       f"{new.get('synthetic_prompts_config')}")
        for asset in CHAIN[2:-1]:
            if old[f"{asset}_version"] != new[f"{asset}_version"]:
                out.append(f"{asset} changed: {str(old[f'{asset}_version'])[:12]} -> {str(new[f'{asset}_version'])[:12]}")
    code = [f"{a} {old.get(k)} -> {new.get(k)}" for a in CODED if old.get(k := f"{a}_code_version") != new.get(k)]
    if code:
        out.append("the code changed: " + ", ".join(code))
    if old["engine_version"] != new["engine_version"]:
        out.append(f"new engine version: {old['engine']} {old['engine_version']} -> {new['engine_version']}")
    if old["target_model_version"] != new["target_model_version"]:
        out.append(f"new target: {str(old['target_model_version'])[:12]} -> {str(new['target_model_version'])[:12]}")
    if old["settings"] != new["settings"]:
        out.append(f"changed settings: {old['settings']} -> {new['settings']}")
    return out or ["nothing in the lineage changed: the same inputs measured differently (noise, or the host)"]
