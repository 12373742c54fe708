"""Acting on drift: the jobs of the loop and the sensor that starts a retraining when drift is reported.

- `retrain_on_traffic` (per engine): the newest traffic days retrained into a challenger to the drafter in
  production, the promotion gate, the challenger's speculation schedule and its promotion when the gate passes, the
  rollout. Its runs carry the tag
  eagle3/retrain=<engine>: with the queue's limit of one per value (dagster_home/dagster.yaml), two at once for
  one engine never run together, and the sensor starts none while one is queued or running.
- `rollout` (per engine): the production drafter put on the servers again (after a promotion or a rollback by hand).
- `retrain_on_drift_sensor`: off by default (GPU work, as schedules that spend the GPU are): each new drift report
  (a collapse excepted: an integration fault of the server, which retraining cannot fix) starts
  `retrain_on_traffic` for the engine of the server it is about (the default engine for an offline one), with the
  run config in EAGLE3_RETRAIN_CONFIG. A retraining that gave up for too little traffic (retrain_data
  waited wait_for_traffic_s) leaves its drift unanswered: the sensor says so (its skip reason, an observation on
  drift_report), reads today's traffic again every reread_every_s (`read_traffic`), and retries once per growth of
  the newest traffic day or per new day: the run key is the traffic seen, so ticks never repeat a retry."""


import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg
import yaml

from ..assets.executor import ONE_PROCESS
from ..assets.partitions import engine_partitions
from ..common.engines import DEFAULT
from ..eye.servers_file import ServersFile
from ..eye.traffic import traffic_partitions
from ..eye.traffic_days import read_traffic_job  # today's traffic read again while a drift waits for it
from .retrain import TRAFFIC_READ_TAG, WAITING, RetrainDataConfig, traffic_prompts, traffic_read_config

RETRAIN_TAG = "eagle3/retrain"
# which drift report (its storage id in the event log) on which server a retraining answers: the run's lineage in the UI
REPORT_TAG, SERVER_TAG = "eagle3/drift_report", "eagle3/drift_server"
REPORT, RETRAIN_DATA, TRAFFIC = dg.AssetKey("drift_report"), dg.AssetKey("retrain_data"), dg.AssetKey("traffic")
CONFIG_ENV = "EAGLE3_RETRAIN_CONFIG"  # a run-config YAML the sensor's retrainings run with (sizes, engine launch)
LOOP = ["retrain_data", "retrain_conversations", "retrain_shards", "challenger_drafter", "challenger_export",
        "promotion_gate", "challenger_schedule", "production_drafter", "rollout"]

retrain_on_traffic_job = dg.define_asset_job(
    "retrain_on_traffic", selection=LOOP, partitions_def=engine_partitions, executor_def=ONE_PROCESS,
    config=dg.PartitionedConfig(partitions_def=engine_partitions, run_config_for_partition_key_fn=lambda key: {},
                                tags_for_partition_key_fn=lambda key: {RETRAIN_TAG: key}),
    description="the newest traffic days into a challenger finetuned from the drafter in production, the promotion "
                "gate, the challenger's speculation schedule and its promotion when the gate passes, the rollout "
                "(partition: the engine)")
rollout_job = dg.define_asset_job("rollout_drafter", selection=["rollout"], partitions_def=engine_partitions,
                                  executor_def=ONE_PROCESS,
                                  description="put the drafter in production on the engine's servers, one at a time")


ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
          dg.DagsterRunStatus.STARTED]


def active(instance: dg.DagsterInstance, engine: str) -> list:
    """Retraining runs of the engine queued or running."""
    return instance.get_runs(dg.RunsFilter(tags={RETRAIN_TAG: engine}, statuses=ACTIVE))


def run_config() -> dict:
    """EAGLE3_RETRAIN_CONFIG's ops for the loop's assets (empty: their defaults)."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    ops = (yaml.safe_load(Path(path).read_text()) or {}).get("ops", {})
    return {"ops": {k: v for k, v in ops.items() if k in LOOP}}


def selection(config: dict) -> list[dg.AssetKey] | None:
    """The loop's assets a retraining runs: all of them (None), or without retrain_shards when the challenger trains
    online (hidden_states: online: the target's states computed as it trains, no shard extracted)."""
    train = config.get("ops", {}).get("challenger_drafter", {}).get("config", {})
    return [dg.AssetKey(a) for a in LOOP if a != "retrain_shards"] if train.get("hidden_states") == "online" else None


def settings() -> RetrainDataConfig:
    """retrain_data's settings in EAGLE3_RETRAIN_CONFIG (reread_every_s is the sensor's)."""
    return RetrainDataConfig(**run_config().get("ops", {}).get("retrain_data", {}).get("config", {}))


def unanswered(w: dict) -> str:
    t = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(w["at"]))
    return f"drift reported at {t} for server {w['server'] or '(offline)'} is unanswered"


def build(parsed: ServersFile | None) -> dg.SensorDefinition:
    engines = {s.name: s.engine for s in parsed.servers} if parsed else {}

    @dg.sensor(name="retrain_on_drift_sensor", jobs=[retrain_on_traffic_job, read_traffic_job],
               # a tick reads the event log only: a drift is answered within half a minute, not a whole one
               minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED,
               description="each new drift report starts retrain_on_traffic for its engine (off by default: GPU "
                           "work); one that gave up for too little traffic is retried when the traffic grows")
    def retrain_on_drift_sensor(context: dg.SensorEvaluationContext):
        # the cursor: the last drift report read, and per engine the drift its retraining has not answered yet
        raw = json.loads(context.cursor) if context.cursor else {}
        cur = {"after": raw} if isinstance(raw, int) else raw  # before the retries: the storage id alone
        waiting, now, instance = cur.setdefault("waiting", {}), time.time(), context.instance
        requests, said, events = [], [], []

        def retrain(engine: str, key: str, report: int, server: str) -> None:
            config = run_config()
            requests.append(dg.RunRequest(run_key=key, job_name=retrain_on_traffic_job.name, partition_key=engine,
                                          run_config=config, asset_selection=selection(config),
                                          tags={RETRAIN_TAG: engine, REPORT_TAG: str(report),
                                                SERVER_TAG: server or "(offline)"}))

        recs = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=REPORT, after_storage_id=cur.get("after")), limit=50, ascending=True).records
        for rec in recs:
            cur["after"] = rec.storage_id
            m = rec.event_log_entry.asset_materialization.metadata
            server = getattr(m.get("server"), "value", "")
            if getattr(m.get("signal"), "value", "") == "collapse":  # the server's fault: retraining cannot fix it
                said.append(f"drift report {rec.storage_id} is a collapse on {server}, not drift: not retrained "
                            "(fix the server's integration: its report lists the evidence)")
                continue
            engine = engines.get(server, DEFAULT)
            if active(instance, engine) or any(r.partition_key == engine for r in requests):
                said.append(f"drift report {rec.storage_id}: a retraining for {engine} is queued or running")
                continue
            retrain(engine, f"drift-{rec.storage_id}", rec.storage_id, server)
            waiting[engine] = {"report": rec.storage_id, "server": server, "at": rec.timestamp, "since": now}

        for engine, w in list(waiting.items()):
            if active(instance, engine) or any(r.partition_key == engine for r in requests):
                continue  # its retraining is queued or running (and waits for traffic, saying so, if it must)
            if "tried" not in w:  # the retraining started for it has ended, or not begun yet
                run = next(iter(instance.get_runs(dg.RunsFilter(tags={RETRAIN_TAG: engine}, statuses=[
                    dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED],
                    created_after=datetime.fromtimestamp(w["since"], tz=timezone.utc)), limit=1)), None)
                if run is None:
                    continue
                obs = next(iter(instance.fetch_observations(RETRAIN_DATA, limit=1).records), None)
                if obs is None or obs.run_id != run.run_id:  # it ran (or failed for another reason: its run says)
                    events.append(dg.AssetObservation(asset_key=REPORT, metadata={
                        "report": w["report"], "server": w["server"], "state": "answered",
                        "retraining": dg.MetadataValue.dagster_run(run.run_id), "status": run.status.value}))
                    del waiting[engine]
                    continue
                m = {k: v.value for k, v in obs.event_log_entry.asset_observation.metadata.items()}
                w["tried"] = {k: m[k] for k in ("traffic_day", "traffic_prompts", "train_prompts", "min_prompts")}
                w["run"] = run.run_id
                events.append(dg.AssetObservation(asset_key=REPORT, metadata={
                    "report": w["report"], "server": w["server"], "state": f"unanswered: {WAITING}",
                    **w["tried"], "retraining": dg.MetadataValue.dagster_run(run.run_id)}))
            tried = w["tried"]
            day = max(instance.get_materialized_partitions(TRAFFIC), default="")
            have = traffic_prompts(instance, day) or 0 if day else 0
            if day > tried["traffic_day"] or (day == tried["traffic_day"] and have > tried["traffic_prompts"]):
                # the run key is the traffic seen: one retry per day and per growth, whatever the ticks
                retrain(engine, f"drift-{w['report']}-retry-{day}-{have}", w["report"], w["server"])
                w.pop("tried")
                w["since"] = now
                continue
            why = (f"{unanswered(w)}: {WAITING} ({tried['train_prompts']} of {tried['min_prompts']} training prompts "
                   f"in {tried['traffic_day']}'s {tried['traffic_prompts']} prompts, run {w['run'][:8]}); retried when "
                   "that day's traffic grows or a new day's arrives")
            cfg = traffic_read_config(instance)
            if cfg is None:
                why += "; no gateway logs are known to read it again: materialize traffic for today when more came"
            elif now - w.get("reread", 0) >= settings().reread_every_s and not instance.get_runs(dg.RunsFilter(
                    tags={TRAFFIC_READ_TAG: engine}, statuses=ACTIVE), limit=1):
                today = traffic_partitions.get_last_partition_key()
                requests.append(dg.RunRequest(run_key=f"drift-{w['report']}-read-{int(now)}",
                                              job_name=read_traffic_job.name, partition_key=today,
                                              run_config={"ops": {"traffic": {"config": cfg}}} if cfg else {},
                                              tags={TRAFFIC_READ_TAG: engine}))
                w["reread"] = now
                why += f"; reading {today}'s traffic again now (every reread_every_s {settings().reread_every_s} s)"
            said.append(why)
            context.log.info(why)

        return dg.SensorResult(run_requests=requests, asset_events=events, cursor=json.dumps(cur),
                               skip_reason="; ".join(said) if said and not requests else None)

    return retrain_on_drift_sensor
