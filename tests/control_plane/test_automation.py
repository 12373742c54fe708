"""The schedule re-benchmarks and never retrains; the definitions carry the sensor that reports regressions."""

import json
from datetime import datetime

import dagster as dg

from eagle3_assets.definitions import defs


def test_nightly_schedule_targets_exactly_the_benchmark_on_each_engine(monkeypatch):
    monkeypatch.setenv("EAGLE3_BENCH_ENGINES", "vllm,sglang")
    schedule = defs.get_schedule_def("nightly_rebenchmark")
    job = defs.resolve_job_def(schedule.job_name)
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == {"serving_benchmark"}
    ctx = dg.build_schedule_context(scheduled_execution_time=datetime(2026, 12, 1, 3),
                                    repository_def=defs.get_repository_def())
    requests = list(schedule.evaluate_tick(ctx).run_requests)
    assert [r.partition_key for r in requests] == ["vllm", "sglang"]
    assert len({r.run_key for r in requests}) == 2


def test_regression_sensor_is_on_by_default_and_reports_through_its_own_job():
    sensor = defs.get_sensor_def("benchmark_regression_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    job = defs.resolve_job_def(sensor.job_name)
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == {"benchmark_regression"}


def test_a_drop_is_judged_against_the_previous_result_with_the_same_engine_and_settings():
    from eagle3_assets.automation import regressions

    def row(i, al, speedup, settings="{}", engine="vllm"):
        return {"storage_id": i, "engine": engine, "settings": settings, "acceptance_length": al, "speedup": speedup}

    rows = [row(1, 2.00, 1.50), row(2, 1.10, 0.80, settings='{"limit": 2}'), row(3, 1.97, 1.48),
            row(4, 1.80, 1.47), row(5, 1.0, 0.5, engine="sglang")]
    assert regressions(rows, rows[0]) is None                      # nothing before it
    assert regressions(rows, rows[1]) is None                      # other settings: not comparable
    assert regressions(rows, rows[2]) is None                      # -1.5 %: noise below the 5 % threshold
    why, old = regressions(rows, rows[3])                          # -8.6 % against #3, not #1
    assert old["storage_id"] == 3 and why.startswith("vllm: acceptance_length 1.970 -> 1.800")
    assert regressions(rows, rows[4]) is None                      # another engine's first result


def _result(instance: dg.DagsterInstance, acceptance_length: float, engine: str = "vllm") -> int:
    """A serving_benchmark result (reported outside a run: its lineage is just itself), its storage id."""
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "serving_benchmark", partition=engine,
        metadata={"engine": engine, "acceptance_length": acceptance_length, "speedup": 1.5}))
    return instance.fetch_materializations(dg.AssetKey("serving_benchmark"), limit=1).records[0].storage_id


def test_the_sensor_reads_each_new_result_once_and_walks_no_lineage(tmp_path, monkeypatch):
    """The cursor carries what a new result is compared with: a tick without new results reads none, a new
    one is read and judged once, and a cursor from before that state was kept is caught up once. The lineage
    is left to the report run."""
    from dagster._core.definitions.asset_checks.asset_check_evaluation import (
        AssetCheckEvaluationTargetMaterializationData,
    )

    from eagle3_assets import automation, lineage

    walked, chains = [], []
    judged, chain = automation._judged, lineage.chain
    monkeypatch.setattr(automation, "_judged", lambda inst, rec: walked.append(rec.storage_id) or judged(inst, rec))
    monkeypatch.setattr(lineage, "chain", lambda inst, rec: chains.append(rec.storage_id) or chain(inst, rec))
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        def tick(cursor):
            walked.clear()
            return automation.benchmark_regression_sensor.evaluate_tick(
                dg.build_sensor_context(instance=instance, cursor=cursor))

        first, second, other = _result(instance, 2.0), _result(instance, 1.98), _result(instance, 1.0, "sglang")
        start = tick(None)
        assert walked == [first, second, other] and start.run_requests == []
        idle = tick(start.cursor)
        assert walked == [] and idle.run_requests == [] and idle.cursor == start.cursor
        drop = _result(instance, 1.5)
        found = tick(idle.cursor)
        assert walked == [drop]
        assert [(r.run_key, r.run_config["ops"]["benchmark_regression"]["config"]["old_storage_id"])
                for r in found.run_requests] == [(f"drop-{drop}", second)]
        assert tick(found.cursor).run_requests == [] and walked == []
        legacy = tick(json.dumps({"bench": drop, "checks": 0}))
        assert legacy.run_requests == [] and sorted(walked) == [first, second, other, drop]

        # a failed check on the newest result: reported once, against the previous result on its engine
        rec = lineage.record(instance, "serving_benchmark", drop)
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=lineage.BENCHMARK, check_name="speedup_above_1", passed=False,
            severity=dg.AssetCheckSeverity.WARN, description="slower",
            target_materialization_data=AssetCheckEvaluationTargetMaterializationData(
                storage_id=drop, run_id=rec.run_id, timestamp=rec.timestamp)))
        checked = tick(found.cursor)
        assert walked == []
        [request] = checked.run_requests
        config = request.run_config["ops"]["benchmark_regression"]["config"]
        assert request.run_key.startswith("check-")
        assert (config["new_storage_id"], config["old_storage_id"]) == (drop, second)  # not the sglang one
        assert config["why"].startswith("vllm: check speedup_above_1 failed")
        assert tick(checked.cursor).run_requests == [] and chains == []


def test_each_finished_traffic_day_is_read_on_its_own_when_the_logs_are_set(tmp_path):
    """The daily schedule asks for the day before its tick (where days begin), once per day; it is on by default only
    where EAGLE3_TRAFFIC_LOGS names the logs (the code location reads it as it loads)."""
    import subprocess
    import sys

    schedule = defs.get_schedule_def("read_traffic_daily")
    job = defs.resolve_job_def(schedule.job_name)
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == {"traffic"}
    ctx = dg.build_schedule_context(scheduled_execution_time=datetime(2026, 12, 5, 0, 30),
                                    repository_def=defs.get_repository_def())
    (request,) = schedule.evaluate_tick(ctx).run_requests
    assert request.partition_key == "2026-12-04" and request.run_key == "traffic-2026-12-04"
    status = "from eagle3_assets.eye.traffic_days import read_traffic_daily as s; print(s.default_status.value)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "EAGLE3_TRAFFIC_LOGS"}
    off = subprocess.run([sys.executable, "-c", status], env=env, capture_output=True, text=True, check=True)
    on = subprocess.run([sys.executable, "-c", status], env={**env, "EAGLE3_TRAFFIC_LOGS": str(tmp_path / "*.jsonl")},
                        capture_output=True, text=True, check=True)
    assert (off.stdout.strip(), on.stdout.strip()) == ("STOPPED", "RUNNING")
