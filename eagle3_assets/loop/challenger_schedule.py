"""challenger_schedule (group `loop`, per engine): the speculation schedule of a challenger the gate passed, measured
before it is promoted (the same load_curve stage as speculation_schedule, on challenger_export), so that the rollout
starts every server with the schedule measured for the drafter it rolls out ({speculative_config} in a restart
command), serving_benchmark serves it, and the serving eye knows the batch sizes it was measured at. A challenger
the gate refused is never measured: the gate's blocking checks stop the run before it."""

import dagster as dg

from ..assets.partitions import engine_partitions
from ..assets.speculation_schedule import ScheduleConfig, measure
from ..code_versions import code_version
from ..hosts import GpuHost
from . import production

CHALLENGER = dg.AssetKey("challenger_export")


@dg.asset(group_name="loop", partitions_def=engine_partitions, pool="gpu_host",
          deps=["promotion_gate", "challenger_export", "target_model", "prompts"],
          code_version=code_version(__name__, "challenger_schedule"))
def challenger_schedule(context: dg.AssetExecutionContext, config: ScheduleConfig,
                        gpu_host: GpuHost) -> dg.MaterializeResult:
    """The challenger's load curve on the engine (partition) and the schedule by load chosen from it, the launch files
    beside its export; its config is speculation_schedule's."""
    engine = context.partition_key
    chall = production.export_of(context.instance, asset=CHALLENGER)
    if not chall.get(f"{engine}_path"):
        raise dg.Failure(description=f"challenger_export has no {engine} dialect: export the challenger for {engine}")
    return measure(context, config, gpu_host, chall[f"{engine}_path"], chall["checkpoint"] or "unknown")
