"""What runs by itself: the nightly re-benchmark of the current drafter on each configured engine (never a
retrain), and the sensor that turns a drop in a benchmark, or a failed benchmark check, into a report run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import yaml

from . import lineage
from .assets.serving import CONSISTENCY, SPEEDUP, engine_partitions

# A drop beyond these fractions of the previous result (same engine, same settings) is a regression.
ACCEPTANCE_DROP = float(os.environ.get("EAGLE3_REGRESSION_ACCEPTANCE_DROP", "0.05"))
SPEEDUP_DROP = float(os.environ.get("EAGLE3_REGRESSION_SPEEDUP_DROP", "0.10"))

rebenchmark_job = dg.define_asset_job(
    "rebenchmark", selection=["serving_benchmark"], partitions_def=engine_partitions,
    description="re-measure the current export on an engine; never retrains or re-exports")
regression_report_job = dg.define_asset_job(
    "regression_report", selection=["benchmark_regression"],
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
    """Each engine in EAGLE3_BENCH_ENGINES (default: vllm) re-measures the current drafter export."""
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    for engine in os.environ.get("EAGLE3_BENCH_ENGINES", "vllm").split(","):
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


def _previous_storage_id(rows: list[dict], new: dict) -> int:
    """The result before `new` on the same engine (any settings): context for a failed check's report."""
    same = [r for r in rows if r["storage_id"] < new["storage_id"] and r["engine"] == new["engine"]]
    return same[-1]["storage_id"] if same else new["storage_id"]


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
    `benchmark_regression` report run that names what changed in the lineage."""
    cursor = json.loads(context.cursor) if context.cursor else {"bench": 0, "checks": 0}
    records = lineage.benchmark_records(context.instance)
    rows = [lineage.history_row(context.instance, r) for r in records]
    for row in rows:
        if row["storage_id"] <= cursor["bench"]:
            continue
        cursor["bench"] = max(cursor["bench"], row["storage_id"])
        if (found := regressions(rows, row)) is not None:
            why, old = found
            yield _report(row["storage_id"], old["storage_id"], why, f"drop-{row['storage_id']}")
    for check_id, target, why in _failed_checks(context.instance, cursor["checks"]):
        cursor["checks"] = max(cursor["checks"], check_id)
        checked = [r for r in rows if target is None or r["storage_id"] == target] or rows[-1:]
        if checked:
            row = checked[-1]
            yield _report(row["storage_id"], _previous_storage_id(rows, row), f"{row['engine']}: {why}",
                          f"check-{check_id}")
    context.update_cursor(json.dumps(cursor))


def _report(new: int, old: int, why: str, key: str) -> dg.RunRequest:
    return dg.RunRequest(run_key=key, run_config={"ops": {"benchmark_regression": {"config": {
        "new_storage_id": new, "old_storage_id": old, "why": why[:2000]}}}}, tags={"eagle3/regression": key})
