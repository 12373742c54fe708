"""challenger_schedule (group `loop`, per engine): the speculation schedule of a challenger the gate passed, measured
before it is promoted, so that the rollout starts every server with the schedule measured for the drafter it rolls
out ({speculative_config} in a restart command), serving_benchmark serves it, and the serving eye knows the batch
sizes it was measured at. A challenger the gate refused is never measured: the gate's blocking checks stop the run
before it.

Two sources (`source`): `sweep` (the default) measures the same load_curve stage as speculation_schedule on
challenger_export, every k up to the deepest on its grid of concurrencies, a server per k; `gate` takes the schedule
the promotion gate chose from its own batches (the target alone and the challenger at its served k, at the
concurrencies of the production's load mix) and starts no server: at a large target each start is minutes, and the
gate has just measured the load production serves. Batch sizes past the gate's highest concurrency draft as it does;
where the load may grow past what production served, sweep."""

from typing import Literal

import dagster as dg
from pydantic import Field

from ..assets.partitions import engine_partitions
from ..assets.speculation_schedule import ScheduleConfig, measure, plot, table
from ..code_versions import code_version
from ..hosts import GpuHost
from . import production

CHALLENGER = dg.AssetKey("challenger_export")


class ChallengerScheduleConfig(ScheduleConfig):
    source: Literal["sweep", "gate"] = Field(
        default="sweep", description="sweep: a load curve of its own (a server per k on the grid); gate: the schedule "
        "the promotion gate chose from its batches at the production's concurrencies (no server starts)")


@dg.asset(group_name="loop", partitions_def=engine_partitions, pool="gpu_host",
          deps=["promotion_gate", "challenger_export", "target_model", "prompts"],
          code_version=code_version(__name__, "challenger_schedule"))
def challenger_schedule(context: dg.AssetExecutionContext, config: ChallengerScheduleConfig,
                        gpu_host: GpuHost) -> dg.MaterializeResult:
    """The challenger's load curve on the engine (partition) and the schedule by load chosen from it, the launch files
    beside its export; its config is speculation_schedule's, and where it comes from (`source`)."""
    engine = context.partition_key
    chall = production.export_of(context.instance, asset=CHALLENGER)
    if not chall.get(f"{engine}_path"):
        raise dg.Failure(description=f"challenger_export has no {engine} dialect: export the challenger for {engine}")
    checkpoint = chall["checkpoint"] or "unknown"
    if config.source == "gate":
        if changed := sweep_settings(config):  # each would be silently ignored
            raise dg.Failure(description=f"{', '.join(changed)} set with source: gate, where the schedule is the "
                                         "promotion gate's (its concurrencies, its k, a 3 % tolerance, its batch "
                                         "limit): take them out, or set source: sweep to measure with them",
                             allow_retries=False)
        return from_gate(context.instance, engine, checkpoint)
    return measure(context, ScheduleConfig(**config.model_dump(exclude={"source"})), gpu_host,
                   chall[f"{engine}_path"], checkpoint)


def sweep_settings(config: ChallengerScheduleConfig) -> list[str]:
    """The settings given that only a sweep uses (those off their defaults: Dagster's fields_set is not the user's)."""
    return sorted(k for k, f in type(config).model_fields.items()
                  if k != "source" and getattr(config, k) != f.get_default(call_default_factory=True))


def from_gate(instance: dg.DagsterInstance, engine: str, checkpoint: str) -> dg.MaterializeResult:
    """The schedule the newest promotion_gate on `engine` chose for this challenger from its batches, as a sweep's
    metadata; a Failure saying what to do when that gate judged another challenger or chose none."""
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("promotion_gate"), asset_partitions=[engine]), limit=1).records
    if not recs:
        raise dg.Failure(description=f"no promotion_gate on {engine} yet: materialize the gate for this challenger "
                                     "first, or use source: sweep")
    gate = {k: v.value for k, v in recs[0].event_log_entry.asset_materialization.metadata.items()}
    if gate.get("challenger") != checkpoint:
        raise dg.Failure(description=f"the newest promotion_gate on {engine} judged "
                                     f"{str(gate.get('challenger'))[:12]}, not {checkpoint[:12]}: "
                                     "materialize the gate for this challenger first, or use source: sweep")
    if gate.get("promote") is False:
        raise dg.Failure(description=f"the promotion_gate on {engine} refused {checkpoint[:12]} "
                                     f"({gate.get('decision')}): a refused challenger is not rolled out, so it gets "
                                     "no schedule")
    meta = gate.get("schedule_from_batches")
    if not meta:
        why = gate.get("no_schedule_from_batches") or "its batches gave none"
        raise dg.Failure(description=f"the promotion_gate on {engine} chose no schedule from its batches: {why}")
    typed = {k: dg.MetadataValue.json(v) if isinstance(v, dict | list) else dg.MetadataValue.path(v) if k == "path"
             else v for k, v in meta.items() if v is not None}
    return dg.MaterializeResult(
        metadata={**typed, "checkpoint": checkpoint, "gate_storage_id": recs[0].storage_id,
                  "table_md": dg.MetadataValue.md(table(meta)), "load_curve": dg.MetadataValue.md(plot(meta))})
