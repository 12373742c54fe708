"""Retraining on traffic (group `loop`): the newest traffic days become a challenger to the drafter in production.

retrain_data (stage traffic_split) cuts the days into prompts to train on and prompts held out for the promotion
gate; retrain_conversations has the target write their replies (stage generate, as `conversations` does);
retrain_shards extracts their hidden states (stage extract); challenger_drafter finetunes the drafter in production
(`init_from`, through the layer-id check) on them with part of the data it was trained on mixed in (`mix_share`),
so that it does not forget what it served before; challenger_export exports it. Files live under retrain/ on the
host (one retraining at a time: the run queue's tag eagle3/retrain keeps it so), the challenger under
drafter/<run_name>."""

import os
import time

import dagster as dg
from pydantic import Field

from ..assets.partitions import shard_partitions
from ..assets.paths import DRAFTER_DIR, EXPORT_DIR, SHARDS_DIR
from ..assets.upstream import upstream_metadata
from ..code_versions import code_version
from ..common.engines import DEFAULT, NAMES
from ..eye.traffic import LOGS_ENV, TRAFFIC_DIR, traffic, traffic_partitions
from ..hosts import GpuHost
from ..stages.export import ExportSettings
from ..stages.extract import ExtractSettings
from ..stages.generate import GenerateSettings
from ..stages.traffic_split import TrafficSplitSettings
from ..stages.train import TrainSettings
from . import production

RETRAIN_DIR = "retrain"
CONVERSATIONS = f"{RETRAIN_DIR}/conversations.parquet"
SHARDS = f"{RETRAIN_DIR}/hidden_states"


class RetrainDataConfig(dg.Config, TrafficSplitSettings):
    """The traffic_split stage's settings (eagle3_assets/stages/traffic_split.py), and which days it takes."""

    days: int = Field(default=1, gt=0, description="the newest traffic partitions materialized, taken together")
    reread: bool = Field(default=True, description="read today's traffic partition again from the gateway's logs "
                         "before splitting (as its newest materialization read them): a retraining answers a drift "
                         "with the traffic there is when it runs, not with what a drift report read")
    # an hour: the case (drift seen after ~30 requests, the rest over half an hour) is answered by its first
    # retraining; the wait holds the engine's retraining slot, not the GPU (retrain_data takes no gpu_host pool)
    wait_for_traffic_s: int = Field(default=3600, ge=0, description="under min_prompts training prompts: read the "
                                    "day again every poll_traffic_s for up to this long before failing (0: fail at "
                                    "once); after a failure retrain_on_drift_sensor retries when the traffic grows")
    poll_traffic_s: int = Field(default=60, gt=0, description="while waiting for traffic: seconds between reads")
    reread_every_s: int = Field(default=900, ge=60, description="after a retraining gave up for too little traffic: "
                                "how often retrain_on_drift_sensor reads today's traffic again to see it grow (the "
                                "sensor takes it from EAGLE3_RETRAIN_CONFIG)")


WAITING = "waiting for traffic"  # retrain_data's observation when it gives up: the drift it answers is unanswered
TRAFFIC_READ_TAG = "eagle3/traffic_read"  # on a run that reads a traffic day again for the loop: why


def traffic_read_config(instance: dg.DagsterInstance) -> dict | None:
    """The traffic asset's config of its newest materialization, to read a day again the same way (its sources);
    None when no source is known (neither that run's config nor EAGLE3_TRAFFIC_LOGS names one)."""
    rec = next(iter(instance.fetch_materializations(dg.AssetKey("traffic"), limit=1).records), None)
    run = instance.get_run_by_id(rec.run_id) if rec and rec.run_id else None
    cfg = ((run.run_config if run else {}).get("ops", {}).get("traffic", {}) or {}).get("config") or {}
    return cfg if cfg.get("sources") or os.environ.get(LOGS_ENV) else None


def reread_today(context: dg.AssetExecutionContext, gpu_host: GpuHost) -> None:
    """Today's traffic partition materialized again, in a run of its own (recorded as any traffic read)."""
    cfg, day = traffic_read_config(context.instance), traffic_partitions.get_last_partition_key()
    if cfg is None:
        context.log.warning(f"today's traffic ({day}) is not read again: no gateway logs are known (set "
                            f"{LOGS_ENV}, or materialize traffic with `sources`); splitting what is materialized")
        return
    done = dg.materialize([traffic], partition_key=day, instance=context.instance, resources={"gpu_host": gpu_host},
                          run_config={"ops": {"traffic": {"config": cfg}}} if cfg else None, raise_on_error=False,
                          tags={TRAFFIC_READ_TAG: f"retrain_data of run {context.run_id}"})
    if not done.success:
        raise dg.Failure(description=f"reading today's traffic ({day}) again failed: see run {done.run_id}; set "
                                     "reread: false to split the traffic already materialized", allow_retries=False)


def traffic_prompts(instance: dg.DagsterInstance, day: str) -> int | None:
    rec = next(iter(instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("traffic"), asset_partitions=[day]), limit=1).records), None)
    value = rec.event_log_entry.asset_materialization.metadata.get("prompts") if rec else None
    return getattr(value, "value", value)


def served_since(context: dg.AssetExecutionContext) -> float | None:
    """When the drafter in production on the run's engine (its partition) was put there: the requests logged since
    were served by the drafter a retraining finetunes, so only their figures weigh the slices."""
    now = production.current(context.instance, context.run.tags.get("dagster/partition") or DEFAULT)
    return now["when"] if now else None


@dg.asset(group_name="loop", kinds={"parquet"}, deps=["traffic"], code_version=code_version(__name__, "retrain_data"))
def retrain_data(context: dg.AssetExecutionContext, config: RetrainDataConfig, gpu_host: GpuHost):
    """The newest traffic days (today's read again first), cut by a hash of each prompt into prompts to retrain on
    and prompts held out for the promotion gate. Under min_prompts it waits up to wait_for_traffic_s, reading the
    day again, then fails saying so (an observation `waiting for traffic`): nothing is retrained."""
    until = time.time() + config.wait_for_traffic_s
    while True:
        if config.reread:
            reread_today(context, gpu_host)
        done = sorted(context.instance.get_materialized_partitions(dg.AssetKey("traffic")), reverse=True)
        if not done:
            raise dg.Failure(description="no traffic partition is materialized: materialize traffic for the days to "
                                         "retrain on", allow_retries=False)
        days = done[: config.days]
        run = gpu_host.run_stage(context, "traffic_split", {
            "days": [f"{TRAFFIC_DIR}/{d}.parquet" for d in days], "out_dir": RETRAIN_DIR, "short_ok": True,
            "served_since": served_since(context) if config.weight_by else None,
            **config.model_dump(exclude={"days", "reread", "wait_for_traffic_s", "poll_traffic_s", "reread_every_s"})})
        if not run.result.get("short"):
            return run.materialize_result(traffic_days=dg.MetadataValue.json(days))
        have, left = run.result["train_prompts"], until - time.time()
        if left <= 0:
            break
        context.log.info(f"{WAITING}: {have} of min_prompts {config.min_prompts} training prompts in {', '.join(days)}"
                         f"; reading the day again in {config.poll_traffic_s} s, until "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(until))}")
        time.sleep(min(config.poll_traffic_s, left))
    # what this attempt saw, for the UI and for retrain_on_drift_sensor, which retries when the newest day grows
    context.log_event(dg.AssetObservation(asset_key=context.asset_key, metadata={
        "state": WAITING, "train_prompts": have, "min_prompts": config.min_prompts, "traffic_day": days[0],
        "traffic_prompts": traffic_prompts(context.instance, days[0]) or 0, "waited_s": config.wait_for_traffic_s}))
    raise dg.Failure(description=f"{run.result['why']} (after waiting {config.wait_for_traffic_s} s: "
                                 "wait_for_traffic_s; retrain_on_drift_sensor retries when the traffic grows)",
                     metadata={"train_prompts": have, "min_prompts": config.min_prompts}, allow_retries=False)


class RetrainConversationsConfig(dg.Config, GenerateSettings):
    """The generate stage's settings (eagle3_assets/stages/generate.py) for the traffic's replies."""


@dg.asset(group_name="loop", kinds={"pytorch", "parquet"}, deps=["retrain_data", "target_model"], pool="gpu_host",
          code_version=code_version(__name__, "retrain_conversations"))
def retrain_conversations(context: dg.AssetExecutionContext, config: RetrainConversationsConfig, gpu_host: GpuHost):
    """The traffic's training prompts with the target's own replies, as `conversations` regenerates them."""
    split = upstream_metadata(context, "retrain_data")
    run = gpu_host.run_stage(context, "generate", {
        "target": upstream_metadata(context, "target_model")["path"], "prompts": split["train"],
        "out": CONVERSATIONS, **config.model_dump()})
    return run.materialize_result(traffic_days=dg.MetadataValue.json(split["traffic_days"]))


class RetrainShardsConfig(dg.Config, ExtractSettings):
    """The extract stage's settings (eagle3_assets/stages/extract.py)."""


@dg.asset(group_name="loop", kinds={"pytorch", "safetensors"}, deps=["retrain_conversations", "target_model"],
          pool="gpu_host", code_version=code_version(__name__, "retrain_shards"))
def retrain_shards(context: dg.AssetExecutionContext, config: RetrainShardsConfig, gpu_host: GpuHost):
    """The hidden states of the traffic's conversations, one shard (as hidden_state_shards writes them)."""
    conv = upstream_metadata(context, "retrain_conversations")
    run = gpu_host.run_stage(context, "extract", {
        "target": upstream_metadata(context, "target_model")["path"], "conversations": CONVERSATIONS,
        "out_dir": SHARDS, "shard": 0, "samples_per_shard": max(1, int(conv["conversations"])), **config.model_dump()})
    return run.materialize_result(shard=f"{SHARDS}/shard-00000")


class ChallengerConfig(dg.Config, TrainSettings):
    """The train stage's settings (eagle3_assets/stages/train.py) for the finetune of the drafter in production."""

    run_name: str = Field(default="challenger", description="output under drafter/<run_name>")
    # 0.5 measured best (bench/retrain_mix.py, docs/benchmarks.md#acting-on-drift): on traffic in new languages it
    # gained as much on held-out traffic as 0 (1.774 vs 1.767, from 1.397) and kept the old eval set (1.937 vs 1.931;
    # 0 lost 1.7 %), 0.75 gained nothing more for 17 % more steps
    mix_share: float = Field(default=0.5, ge=0, lt=1, description="the share of the training samples drawn from the "
                             "data the drafter in production was trained on (its hidden_state_shards)")
    engine: str = Field(default=DEFAULT, description="whose production drafter is finetuned (" + ", ".join(NAMES) + ")")


def champion(context, engine: str) -> dict:
    """The drafter in production on `engine`, else the newest export (said in the log): what a retraining starts from
    and what the gate holds the challenger to."""
    now = production.current(context.instance, engine)
    if now is not None:
        return {"version": now["version"], "trained_path": now["trained_path"], "export_path": now["export_path"],
                "from": f"production_drafter {engine}"}
    try:
        export = production.export_of(context.instance)
    except ValueError as e:
        raise dg.Failure(description=f"no drafter in production on {engine} and {e}") from None
    context.log.warning(f"no drafter in production on {engine}: starting from the newest drafter_export "
                        f"({str(export['checkpoint'])[:12]}); promote one with `eagle3-assets promote`")
    return {"version": export["checkpoint"], "trained_path": export["source"],
            "export_path": export.get(f"{engine}_path", ""), "from": "the newest drafter_export"}


@dg.asset(group_name="loop", kinds={"pytorch"}, pool="gpu_host",
          deps=["retrain_shards", "retrain_data", "hidden_state_shards", "target_model"],
          code_version=code_version(__name__, "challenger_drafter"))
def challenger_drafter(context: dg.AssetExecutionContext, config: ChallengerConfig, gpu_host: GpuHost):
    """The drafter in production finetuned on the traffic's hidden states, with mix_share of its old data mixed in:
    the challenger the promotion gate holds against it. (Which drafter is in production is read from
    production_drafter's record, not taken as an input: that record is downstream of the gate.)"""
    if config.engine not in NAMES:
        raise dg.Failure(description=f"engine must be one of {list(NAMES)}, got {config.engine!r}")
    champ = champion(context, config.engine)
    registered = set(context.instance.get_dynamic_partitions(shard_partitions.name))
    old = sorted(context.instance.get_materialized_partitions(dg.AssetKey("hidden_state_shards")) & registered)
    days = upstream_metadata(context, "retrain_data")["traffic_days"]
    online = config.hidden_states == "online"
    if online and config.mix_share:
        raise dg.Failure(description="hidden_states online mixes no old data yet (mix_share draws from the old "
                                     "hidden_state_shards): set mix_share 0 for an online retraining, or train offline",
                         allow_retries=False)
    args = {"target": upstream_metadata(context, "target_model")["path"],
            # online: the traffic's conversations, their hidden states computed as it trains (retrain_shards unread)
            **({"conversations": CONVERSATIONS} if online else
               {"shards": [upstream_metadata(context, "retrain_shards")["shard"]]}),
            "mix_shards": [f"{SHARDS_DIR}/shard-{k}" for k in old] if config.mix_share else [],
            "init_from": champ["trained_path"], "out": f"{DRAFTER_DIR}/{config.run_name}",
            **config.model_dump(exclude={"engine", "init_from"})}
    run = gpu_host.run_stage(context, "train", args)
    return run.materialize_result(champion=champ["version"] or "unknown", champion_from=champ["from"],
                                  traffic_days=dg.MetadataValue.json(days), old_shards=len(old) if config.mix_share else 0)


class ChallengerExportConfig(dg.Config, ExportSettings):
    """The export stage's settings (eagle3_assets/stages/export.py)."""


@dg.asset(group_name="loop", kinds={"safetensors"}, deps=["challenger_drafter", "target_model"],
          code_version=code_version(__name__, "challenger_export"))
def challenger_export(context: dg.AssetExecutionContext, config: ChallengerExportConfig, gpu_host: GpuHost):
    """The challenger as the engines load it (exports/<version>/<dialect>), as drafter_export exports."""
    drafter = upstream_metadata(context, "challenger_drafter")
    version = context.instance.get_latest_materialization_event(
        dg.AssetKey("challenger_drafter")).asset_materialization.tags.get("dagster/data_version", "latest")
    run = gpu_host.run_stage(context, "export", {"drafter": drafter["path"],
                                                 "target": upstream_metadata(context, "target_model")["path"],
                                                 "out": f"{EXPORT_DIR}/{version[:12]}", **config.model_dump()})
    return run.materialize_result(traffic_days=dg.MetadataValue.json(drafter.get("traffic_days") or []))
