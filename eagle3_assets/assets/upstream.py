"""Reading what an upstream asset's latest materialization recorded (its host path, its settings), so a
stage uses exactly the artifact that Dagster's lineage says it consumed."""


from typing import Any

import dagster as dg


def upstream_metadata(context: dg.AssetExecutionContext, asset: str) -> dict[str, Any]:
    event = context.instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None or event.asset_materialization is None:
        raise dg.Failure(description=f"{context.asset_key.to_user_string()} needs {asset!r}, which has never "
                                     f"been materialized: materialize {asset} first")
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def exported_checkpoint(context) -> str:
    """The drafter version the served export was made from (not simply the latest drafter: a newer one may
    not have been exported yet)."""
    ev = context.instance.get_latest_materialization_event(dg.AssetKey("drafter_export"))
    return ev.asset_materialization.tags.get("dagster/input_data_version/eagle3_drafter", "unknown")
