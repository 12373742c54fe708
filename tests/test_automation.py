"""The schedule re-benchmarks and never retrains; the definitions carry the sensor that reports regressions."""

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
