"""Acting on drift: the jobs of the loop and the sensor that starts a retraining when drift is reported.

- `retrain_on_traffic` (per engine): the newest traffic days retrained into a challenger to the drafter in
  production, the promotion gate, the promotion when the gate passes, the rollout. Its runs carry the tag
  eagle3/retrain=<engine>: with the queue's limit of one per value (dagster_home/dagster.yaml), two at once for
  one engine never run together, and the sensor starts none while one is queued or running.
- `rollout` (per engine): the production drafter put on the servers again (after a promotion or a rollback by hand).
- `retrain_on_drift_sensor`: off by default (GPU work, as schedules that spend the GPU are): each new drift report
  starts `retrain_on_traffic` for the engine of the server it is about (the default engine for an offline one),
  with the run config in EAGLE3_RETRAIN_CONFIG."""


import os
from pathlib import Path

import dagster as dg
import yaml

from ..assets.partitions import engine_partitions
from ..common.engines import DEFAULT
from ..eye.servers_file import ServersFile

RETRAIN_TAG = "eagle3/retrain"
CONFIG_ENV = "EAGLE3_RETRAIN_CONFIG"  # a run-config YAML the sensor's retrainings run with (sizes, engine launch)
LOOP = ["retrain_data", "retrain_conversations", "retrain_shards", "challenger_drafter", "challenger_export",
        "promotion_gate", "production_drafter", "rollout"]

retrain_on_traffic_job = dg.define_asset_job(
    "retrain_on_traffic", selection=LOOP, partitions_def=engine_partitions,
    config=dg.PartitionedConfig(partitions_def=engine_partitions, run_config_for_partition_key_fn=lambda key: {},
                                tags_for_partition_key_fn=lambda key: {RETRAIN_TAG: key}),
    description="the newest traffic days into a challenger finetuned from the drafter in production, the promotion "
                "gate, the promotion when it passes, the rollout (partition: the engine)")
rollout_job = dg.define_asset_job("rollout_drafter", selection=["rollout"], partitions_def=engine_partitions,
                                  description="put the drafter in production on the engine's servers, one at a time")


def active(instance: dg.DagsterInstance, engine: str) -> list:
    """Retraining runs of the engine queued or running."""
    return instance.get_runs(dg.RunsFilter(tags={RETRAIN_TAG: engine}, statuses=[
        dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED]))


def run_config() -> dict:
    """EAGLE3_RETRAIN_CONFIG's ops for the loop's assets (empty: their defaults)."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    ops = (yaml.safe_load(Path(path).read_text()) or {}).get("ops", {})
    return {"ops": {k: v for k, v in ops.items() if k in LOOP}}


def build(parsed: ServersFile | None) -> dg.SensorDefinition:
    engines = {s.name: s.engine for s in parsed.servers} if parsed else {}

    @dg.sensor(name="retrain_on_drift_sensor", job=retrain_on_traffic_job, minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="each new drift report starts retrain_on_traffic for its engine (off by default: GPU work)")
    def retrain_on_drift_sensor(context: dg.SensorEvaluationContext):
        after = int(context.cursor) if context.cursor else None
        recs = context.instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("drift_report"), after_storage_id=after), limit=50, ascending=True).records
        requests, skipped = [], []
        for rec in recs:
            after = rec.storage_id
            server = getattr(rec.event_log_entry.asset_materialization.metadata.get("server"), "value", "")
            engine = engines.get(server, DEFAULT)
            if active(context.instance, engine) or any(r.partition_key == engine for r in requests):
                skipped.append(f"drift report {rec.storage_id}: a retraining for {engine} is queued or running")
                continue
            requests.append(dg.RunRequest(run_key=f"drift-{rec.storage_id}", partition_key=engine,
                                          run_config=run_config(), tags={RETRAIN_TAG: engine}))
        return dg.SensorResult(run_requests=requests, cursor=str(after) if after is not None else None,
                               skip_reason="; ".join(skipped) if skipped and not requests else None)

    return retrain_on_drift_sensor


