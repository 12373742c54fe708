"""The versions of the inputs a step reads, as Dagster's instance knows them now: what tells a finished job on
the host that it was made from the same inputs (and may be reused) or from older ones (and may not)."""

from __future__ import annotations

import hashlib
import json

import dagster as dg

DATA_VERSION_TAG = "dagster/data_version"


def _version(record) -> str:
    tags = record.event_log_entry.asset_materialization.tags or {}
    return tags.get(DATA_VERSION_TAG) or f"storage-id {record.storage_id}"


def _partition_versions(instance: dg.DagsterInstance, key: dg.AssetKey) -> dict[str, str]:
    ids = instance.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_MATERIALIZATION)
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, storage_ids=list(ids.values())),
                                              limit=max(len(ids), 1)).records
    return {r.event_log_entry.asset_materialization.partition: _version(r) for r in records}


def input_versions(context) -> dict[str, object]:
    """Upstream asset -> its latest data version (every partition's, for a partitioned one); empty for an op."""
    if not getattr(context, "has_assets_def", False):
        return {}
    deps = sorted(context.assets_def.asset_deps.get(context.asset_key, ()), key=lambda k: k.to_user_string())
    out: dict[str, object] = {}
    for key, record in zip(deps, _latest_records(context.instance, deps)):
        if record is None:
            out[key.to_user_string()] = None
        elif record.event_log_entry.asset_materialization.partition is None:
            out[key.to_user_string()] = _version(record)
        else:
            out[key.to_user_string()] = _partition_versions(context.instance, key)
    return out


def _latest_records(instance: dg.DagsterInstance, keys: list[dg.AssetKey]) -> list:
    by_key = {r.asset_entry.asset_key: r.asset_entry.last_materialization_record
              for r in instance.get_asset_records(keys)} if keys else {}
    return [by_key.get(k) for k in keys]


def digest(versions: dict) -> str:
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]
