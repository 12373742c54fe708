"""What runs by itself: the nightly re-benchmark of the current drafter on each configured engine (never a
retrain), and the sensor that turns a drop in a benchmark, or a failed benchmark check, into a report run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import dagster as dg
import yaml

from . import lineage
from .assets.executor import ONE_PROCESS
from .assets.partitions import engine_partitions
from .assets.serving import CONSISTENCY, SPEEDUP
from .common.engines import DEFAULT

# A drop beyond these fractions of the previous result (same engine, same settings) is a regression.
ACCEPTANCE_DROP = float(os.environ.get("EAGLE3_REGRESSION_ACCEPTANCE_DROP", "0.05"))
SPEEDUP_DROP = float(os.environ.get("EAGLE3_REGRESSION_SPEEDUP_DROP", "0.10"))

rebenchmark_job = dg.define_asset_job(
    "rebenchmark", selection=["serving_benchmark"], partitions_def=engine_partitions, executor_def=ONE_PROCESS,
    description="re-measure the current export on an engine; never retrains or re-exports")
regression_report_job = dg.define_asset_job(
    "regression_report", selection=["benchmark_regression"], executor_def=ONE_PROCESS,
    description="made by benchmark_regression_sensor: what dropped, and what differs in the lineage")


def _bench_run_config() -> dict:
    """EAGLE3_BENCH_CONFIG: a run-config YAML with the benchmark settings the nightly runs use (so they are
    comparable night to night); empty: the asset defaults."""
    path = os.environ.get("EAGLE3_BENCH_CONFIG")
    if not path:
        return {}
    ops = (yaml.safe_load(Path(path).read_text()) or {}).get("ops", {})
    return {"ops": {"serving_benchmark": ops["serving_benchmark"]}} if "serving_benchmark" in ops else {}


@dg.schedule(job=rebenchmark_job, cron_schedule=os.environ.get("EAGLE3_BENCH_CRON", "0 3 * * *"),
             default_status=dg.DefaultScheduleStatus.STOPPED)
def nightly_rebenchmark(context: dg.ScheduleEvaluationContext):
    """Each engine in EAGLE3_BENCH_ENGINES (default: the reference engine, vllm) re-measures the current drafter
    export."""
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    for engine in os.environ.get("EAGLE3_BENCH_ENGINES", DEFAULT).split(","):
        yield dg.RunRequest(run_key=f"{engine.strip()}-{day}", partition_key=engine.strip(),
                            run_config=_bench_run_config())


def regressions(rows: list[dict], new: dict) -> tuple[str, dict] | None:
    """(why, the previous row) when `new` dropped against the previous row with the same engine and
    settings, else None."""
    previous = [r for r in rows if r["storage_id"] < new["storage_id"] and r["engine"] == new["engine"]
                and r["settings"] == new["settings"]]
    if not previous:
        return None
    old = previous[-1]
    why = []
    for key, limit in (("acceptance_length", ACCEPTANCE_DROP), ("speedup", SPEEDUP_DROP)):
        a, b = old[key], new[key]
        if a is not None and b is not None and b < a * (1 - limit):
            why.append(f"{key} {a:.3f} -> {b:.3f} ({(b - a) / a:+.1%}, threshold -{limit:.0%})")
    return (f"{new['engine']}: " + ", ".join(why), old) if why else None


def _judged(instance: dg.DagsterInstance, rec) -> dict:
    """What a result is judged on: engine, settings and figures. Read from the result and its run only: its
    lineage is walked by the report, for the results that dropped."""
    meta = rec.event_log_entry.asset_materialization.metadata
    return {"storage_id": rec.storage_id, "engine": lineage.engine_of(rec),
            "settings": lineage.settings_of(instance, rec),
            **{k: meta[k].value if k in meta else None for k in ("acceptance_length", "speedup")}}


def _series(row: dict) -> str:
    """The results a new one is compared with: one engine, one set of benchmark settings (hashed, to keep the
    cursor small)."""
    return hashlib.sha256(f"{row['engine']}\0{row['settings']}".encode()).hexdigest()[:16]


def _previous_same_engine(instance: dg.DagsterInstance, rec) -> int:
    """The result before `rec` on the same engine (any settings), else `rec` itself: context for a failed
    check's report. Reads metadata only, newest first, so it stops at the first match."""
    engine = lineage.engine_of(rec)
    older = lineage.benchmark_records_between(instance, before=rec.storage_id, ascending=False, page=50)
    return next((r.storage_id for r in older if lineage.engine_of(r) == engine), rec.storage_id)


def _failed_checks(instance: dg.DagsterInstance, after: int) -> list[tuple[int, int | None, str]]:
    """(check execution id, storage id of the checked benchmark, why) for failed serving_benchmark checks
    newer than `after`. Read from the check-execution records: the default SQLite event log is sharded by
    run and cannot be scanned across runs by cursor."""
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

    out = []
    for name in (CONSISTENCY, SPEEDUP):
        key = dg.AssetCheckKey(lineage.BENCHMARK, name)
        for rec in instance.event_log_storage.get_asset_check_execution_history(
                key, limit=100, status={AssetCheckExecutionRecordStatus.FAILED}):
            ev = rec.evaluation
            if rec.id <= after or ev is None:
                continue
            target = ev.target_materialization_data.storage_id if ev.target_materialization_data else None
            out.append((rec.id, target, f"check {name} failed ({ev.severity.value}): {ev.description or ''}"))
    return sorted(out)


@dg.sensor(job=regression_report_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def benchmark_regression_sensor(context: dg.SensorEvaluationContext):
    """Each new serving_benchmark result against the previous one with the same engine and settings; a drop
    beyond the thresholds, or a failed benchmark check (Dagster OSS does not alert on those), becomes a
    `benchmark_regression` report run that names what changed in the lineage.

    The cursor holds the last result and check handled, and per engine and settings the figures of the latest
    result: a tick reads only the results after it, each once, and walks no lineage."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    done, last = cursor.get("bench", 0), cursor.get("last")
    # No per-series state yet (the first tick, or a cursor from before it was kept): build it from the first
    # result, once; results up to `done` were judged by earlier ticks and are not reported again.
    start, last = (done, last) if last is not None else (0, {})
    for rec in lineage.benchmark_records_between(context.instance, after=start):
        row = _judged(context.instance, rec)
        series = _series(row)
        if row["storage_id"] > done and series in last:
            previous = {**last[series], "engine": row["engine"], "settings": row["settings"]}
            if (found := regressions([previous, row], row)) is not None:
                yield _report(row["storage_id"], previous["storage_id"], found[0], f"drop-{row['storage_id']}")
        last[series] = {k: row[k] for k in ("storage_id", "acceptance_length", "speedup")}
        done = max(done, row["storage_id"])
    checks = cursor.get("checks", 0)
    for check_id, target, why in _failed_checks(context.instance, checks):
        checks = max(checks, check_id)
        rec = lineage.record(context.instance, "serving_benchmark", target) if target is not None else None
        rec = rec or next(lineage.benchmark_records_between(context.instance, ascending=False, page=1), None)
        if rec is not None:
            yield _report(rec.storage_id, _previous_same_engine(context.instance, rec),
                          f"{lineage.engine_of(rec)}: {why}", f"check-{check_id}")
    context.update_cursor(json.dumps({"bench": done, "checks": checks, "last": last}))


def _report(new: int, old: int, why: str, key: str) -> dg.RunRequest:
    return dg.RunRequest(run_key=key, run_config={"ops": {"benchmark_regression": {"config": {
        "new_storage_id": new, "old_storage_id": old, "why": why[:2000]}}}}, tags={"eagle3/regression": key})
