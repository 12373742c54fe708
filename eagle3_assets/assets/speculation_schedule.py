"""speculation_schedule (per engine): the exported drafter's load curve on the real engine, and the schedule by load
chosen from it (stage `load_curve`): how many tokens to draft at each batch size, none where the target alone is
faster. Production serves many requests at once, and a drafter that pays alone can slow a loaded server down (a
fixed k = 3 measured 1.51x alone and 0.81x at 16 requests on 2 cores). The launch files sit beside the export, in
each engine's own form (eagle3_assets/common/spec_schedule.py)."""

from pathlib import Path

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..common import charts
from ..hosts import GpuHost
from ..stages.load_curve import LoadCurveSettings
from .partitions import engine_partitions
from .paths import PROMPT_SETS
from .upstream import exported_checkpoint, upstream_metadata


class ScheduleConfig(dg.Config, LoadCurveSettings):
    """The load_curve stage's settings (eagle3_assets/stages/load_curve.py) and the prompts it cycles."""
    eval_set: str = Field(default="eval", description="prompt set the requests come from: eval, humaneval or train")


@dg.asset(group_name="serving", partitions_def=engine_partitions, pool="gpu_host",
          deps=["drafter_export", "target_model", "prompts"], code_version=code_version(__name__, "speculation_schedule"))
def speculation_schedule(context: dg.AssetExecutionContext, config: ScheduleConfig,
                         gpu_host: GpuHost) -> dg.MaterializeResult:
    """Output throughput and time per output token at each concurrency of the grid, for the target alone and each k
    up to num_speculative_tokens, the servers measured in turn; the k per batch-size range chosen from it, and the
    files each engine is started with (vLLM's speculative config, SGLang's adaptive config) beside the export."""
    engine = context.partition_key
    if config.eval_set not in PROMPT_SETS:
        raise dg.Failure(description=f"eval_set must be one of {sorted(PROMPT_SETS)}, got {config.eval_set!r}")
    export = upstream_metadata(context, "drafter_export")
    if f"{engine}_path" not in export:
        raise dg.Failure(description=f"drafter_export has no {engine} export: materialize drafter_export with {engine} "
                                     "among its dialects")
    checkpoint = exported_checkpoint(context)
    served = export[f"{engine}_path"]
    run = gpu_host.run_stage(context, "load_curve", {
        "engine": engine, "target": upstream_metadata(context, "target_model")["path"], "drafter": served,
        "prompts": PROMPT_SETS[config.eval_set], "out_dir": str(Path(served).parent / f"{engine}-launch"),
        **config.model_dump(exclude={"eval_set"})})
    meta = run.result
    return run.materialize_result(checkpoint=checkpoint, table_md=dg.MetadataValue.md(table(meta)),
                                  load_curve=dg.MetadataValue.md(plot(meta)))


def table(meta: dict) -> str:
    ks = meta["ks"]
    head = "| concurrency | " + " | ".join("target alone" if k == 0 else f"k={k}" for k in ks) + \
           " | chosen k | speedup |\n|" + "---|" * (len(ks) + 3) + "\n"
    return head + "".join(
        f"| {r['concurrency']} | " + " | ".join(f"{r[f'k{k}_tok_s']:.1f}" for k in ks) +
        f" | {r['k']} | {r['speedup']:.2f}x |\n" for r in meta["table"]) + \
        f"\nTokens/s of output. Schedule: {meta['schedule_text']}; tolerance {meta['tolerance']:.0%}."


def plot(meta: dict) -> str:
    """Throughput against concurrency, a line per k."""
    grid = meta["grid"]
    series = {("target alone" if k == "0" else f"k={k}"): [row[str(c)] for c in grid] for k, row in meta["curve"].items()}
    return charts.curves(series, x_label="concurrency " + ", ".join(map(str, grid)))


SCHEDULE_CHECK = "schedule_never_slower"


def schedule_for(instance: dg.DagsterInstance, engine: str, checkpoint: str) -> tuple[dict | None, str]:
    """The newest speculation_schedule measured for this checkpoint on this engine, or None and why not."""
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("speculation_schedule"), asset_partitions=[engine]), limit=1).records
    if not recs:
        return None, f"no speculation_schedule on {engine}: materialize it (job measure_schedule) for this checkpoint"
    meta = {k: v.value for k, v in recs[0].event_log_entry.asset_materialization.metadata.items()}
    if meta.get("checkpoint") != checkpoint:
        return None, (f"the newest speculation_schedule on {engine} was measured for checkpoint "
                      f"{str(meta.get('checkpoint'))[:12]}, not {checkpoint[:12]}: materialize it for this one")
    return meta, f"the speculation schedule measured for {checkpoint[:12]}: {meta['schedule_text']}"


def _where(meta: dict) -> tuple:
    """What a schedule is true for besides the drafter: the engine's version and the host's processor (its CPU and
    instruction sets, or its GPU) and the dtype computed in."""
    return (meta.get("engine_version"), meta.get("cpu"), str(meta.get("cpu_isa")), meta.get("dtype"))


def schedule_check(bench: dict, sched: dict | None, why: str, tolerance: float) -> dg.AssetCheckResult:
    """The scheduled server at every concurrency measured, against the target alone (now) and the best fixed k (from
    the schedule's own curve, as a ratio to the target alone then): never below either by more than `tolerance`."""
    if sched is None or not bench.get("schedule"):
        return dg.AssetCheckResult(check_name=SCHEDULE_CHECK, passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description=f"not judged: {why}")
    if _where(bench) != _where(sched):
        return dg.AssetCheckResult(
            check_name=SCHEDULE_CHECK, passed=False, severity=dg.AssetCheckSeverity.WARN,
            description=f"not judged: the schedule was measured on {_where(sched)} (engine version, CPU, ISA, dtype) "
                        f"and served on {_where(bench)}: an engine upgrade or another host re-measures it "
                        "(materialize speculation_schedule)")
    fixed = {r["concurrency"]: max(r[f"k{k}_tok_s"] for k in sched["ks"] if k) / r["k0_tok_s"]
             for r in sched["table"] if r["k0_tok_s"]}
    rows, short = [], []
    for key in sorted((k for k in bench if k.startswith("speedup_c")), key=lambda k: int(k.removeprefix("speedup_c"))):
        c, s = int(key.removeprefix("speedup_c")), float(bench[key])
        bar = max(1.0, fixed.get(c, 1.0))
        rows.append({"concurrency": c, "scheduled_speedup": round(s, 3), "best_fixed_k_speedup": round(fixed[c], 3)
                     if c in fixed else None, "k": sched_k(sched, c)})
        if s < (1 - tolerance) * bar:
            short.append(f"{s:.2f}x at {c} (the better of the target alone and the best fixed k: {bar:.2f}x)")
    return dg.AssetCheckResult(
        check_name=SCHEDULE_CHECK, passed=not short, severity=dg.AssetCheckSeverity.WARN,
        metadata={"per_concurrency": dg.MetadataValue.json(rows), "tolerance": tolerance,
                  "schedule": sched["schedule_text"]},
        description=None if not short else "the scheduled server falls short of " + "; ".join(short)
        + f" (tolerance {tolerance:.0%}): re-measure the schedule (speculation_schedule), or widen its grid there")


def sched_k(sched: dict, c: int) -> int:
    for first, last, k in sched["schedule"]:
        if first <= c <= last:
            return k
    return sched["schedule"][-1][2]
