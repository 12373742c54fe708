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
    export = upstream_metadata(context, "drafter_export")
    if f"{context.partition_key}_path" not in export:
        raise dg.Failure(description=f"drafter_export has no {context.partition_key} export: materialize drafter_export "
                                     f"with {context.partition_key} among its dialects")
    return measure(context, config, gpu_host, export[f"{context.partition_key}_path"], exported_checkpoint(context))


def measure(context, config: ScheduleConfig, gpu_host: GpuHost, served: str, checkpoint: str) -> dg.MaterializeResult:
    """The load curve of the export at `served` (the engine's dialect) and its schedule, the launch files beside it;
    also the loop's challenger_schedule (eagle3_assets/loop/challenger_schedule.py)."""
    engine = context.partition_key
    if config.eval_set not in PROMPT_SETS:
        raise dg.Failure(description=f"eval_set must be one of {sorted(PROMPT_SETS)}, got {config.eval_set!r}")
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


# the drafter's own (drafter_export's) and the loop's challenger's, once the gate passed it
SCHEDULES = (dg.AssetKey("speculation_schedule"), dg.AssetKey("challenger_schedule"))
VERIFIED_BY = dg.AssetKey("serving_benchmark")  # where its verification made a schedule fall back to off somewhere


def _records(instance: dg.DagsterInstance, key: dg.AssetKey, engine: str):
    for rec in instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[engine]),
                                               limit=20).records:
        yield rec.storage_id, {k: v.value for k, v in rec.event_log_entry.asset_materialization.metadata.items()}


def schedule_for(instance: dg.DagsterInstance, engine: str, checkpoint: str) -> tuple[dict | None, str]:
    """The newest schedule measured for this checkpoint on this engine (by speculation_schedule, or by
    challenger_schedule for a drafter the loop promoted), or None and why not. Where a serving_benchmark of it since
    made it fall back to off at some concurrency (its verification), the schedule as it fell back: the launch files
    the benchmark rewrote."""
    found, newest = [], None
    for key in SCHEDULES:
        for storage_id, meta in _records(instance, key, engine):
            newest = newest or meta
            if meta.get("checkpoint") == checkpoint:
                found.append((storage_id, meta))
                break
    if found:
        at, meta = max(found, key=lambda f: f[0])
        off: list[int] = []
        # oldest first: a benchmark of a schedule that had fallen back may make it fall back further
        for storage_id, bench in reversed(list(_records(instance, VERIFIED_BY, engine))):
            if storage_id > at and bench.get("checkpoint") == checkpoint and bench.get("verified_schedule") \
                    and meta.get("schedule") is not None and bench.get("schedule") == meta["schedule"]:
                off = sorted({*off, *bench["fell_back_at"]})
                meta = {**meta, "schedule": bench["verified_schedule"], "schedule_text": bench["verified_schedule_text"],
                        "measured_schedule": meta.get("measured_schedule", meta["schedule"]), "fell_back_at": off}
        if off:
            return meta, (f"the speculation schedule measured for {checkpoint[:12]}, off at {off} since its "
                          f"verification (serving_benchmark): {meta['schedule_text']}")
        return meta, f"the speculation schedule measured for {checkpoint[:12]}: {meta['schedule_text']}"
    if newest is None:
        return None, f"no speculation_schedule on {engine}: materialize it (job measure_schedule) for this checkpoint"
    return None, (f"no speculation_schedule on {engine} was measured for checkpoint {checkpoint[:12]} (the newest "
                  f"was for {str(newest.get('checkpoint'))[:12]}): materialize it for this one")


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
    fixed = {r["concurrency"]: best_fixed(r, sched["ks"]) for r in sched["table"] if r["k0_tok_s"]}
    rows, short = [], []
    for key in sorted((k for k in bench if k.startswith("speedup_c")), key=lambda k: int(k.removeprefix("speedup_c"))):
        c, s = int(key.removeprefix("speedup_c")), float(bench[key])
        bar = max(1.0, fixed.get(c, 1.0))
        rows.append({"concurrency": c, "scheduled_speedup": round(s, 3), "best_fixed_k_speedup": round(fixed[c], 3)
                     if c in fixed else None, "k": sched_k(sched, c)})
        if s < (1 - tolerance) * bar:
            short.append(f"{s:.2f}x at {c} (the better of the target alone and the best fixed k: {bar:.2f}x)")
    fell = (f"; its verification made it fall back to off at {bench['fell_back_at']} (the launch files now serve "
            f"{bench['verified_schedule_text']})") if bench.get("fell_back_at") else ""
    return dg.AssetCheckResult(
        check_name=SCHEDULE_CHECK, passed=not short, severity=dg.AssetCheckSeverity.WARN,
        metadata={"per_concurrency": dg.MetadataValue.json(rows), "tolerance": tolerance,
                  "schedule": sched["schedule_text"],
                  **({"verification": dg.MetadataValue.json(bench["verification"])} if bench.get("verification")
                     else {})},
        description=None if not short else "the scheduled server falls short of " + "; ".join(short)
        + f" (tolerance {tolerance:.0%}){fell}: re-measure the schedule (speculation_schedule), or widen its grid there")


def best_fixed(row: dict, ks: list[int]) -> float:
    """The best fixed k's speedup at a sweep's concurrency: the best median of its paired rounds' ratios, or (a sweep
    without rounds) the best tokens/s over the target alone's."""
    medians = [r["median"] for k in ks if k and isinstance(r := row.get(f"k{k}_ratio"), dict) and r.get("median")]
    return max(medians) if medians else max(row[f"k{k}_tok_s"] for k in ks if k) / row["k0_tok_s"]


def sched_k(sched: dict, c: int) -> int:
    for first, last, k in sched["schedule"]:
        if first <= c <= last:
            return k
    return sched["schedule"][-1][2]
