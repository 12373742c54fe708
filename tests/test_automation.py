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
