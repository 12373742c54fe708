"""One tick of benchmark_regression_sensor at 10,000 recorded results, before and after it kept a cursor.

Fills a real temporary Dagster instance (SQLite, as `dagster dev` makes; on /dev/shm when there, so that the
fill's fsyncs do not dominate: the ticks only read) with one materialization of each upstream asset and N
serving_benchmark results pointing at them the way a run records them (input event pointers, data and code
versions), then times, with one new result since the last tick:
- before: the sensor's body as it was up to commit 0015a8b (copied below, `tick_before`): every tick rebuilt
  the history of all results, walking the lineage of each, to judge the new ones;
- after: the sensor now, from its cursor: a tick with no new result and a tick with one; and its first tick
  (no cursor: it reads every result once, without their lineage, to build the per-series state).

    .venv/bin/python bench/sensor_bench.py [--results 10000]

Prints the figures and writes bench/results/sensor_tick.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path

import dagster as dg

from eagle3_assets import lineage
from eagle3_assets.automation import _failed_checks, benchmark_regression_sensor, regressions

OUT = Path(__file__).parent / "results" / "sensor_tick.json"
# asset -> its upstream assets, as the graph has them (what each materialization's pointers name)
UPSTREAM = {"target_model": [], "prompts": [], "conversations": ["target_model", "prompts"],
            "hidden_state_shards": ["conversations", "target_model"],
            "vocab_mapping": ["conversations", "target_model"],
            "eagle3_drafter": ["hidden_state_shards", "vocab_mapping", "target_model"],
            "drafter_export": ["eagle3_drafter", "target_model"]}
BENCH_UPSTREAM = ["drafter_export", "target_model", "prompts"]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def _tags(instance: dg.DagsterInstance, ups: list[str], version: str) -> dict[str, str]:
    tags = {"dagster/data_version": version, "dagster/code_version": "bench"}
    for up in ups:
        rec = instance.fetch_materializations(dg.AssetKey(up), limit=1).records[0]
        tags[f"dagster/input_event_pointer/{up}"] = str(rec.storage_id)
        tags[f"dagster/input_data_version/{up}"] = \
            rec.event_log_entry.asset_materialization.tags["dagster/data_version"]
    return tags


def fill(instance: dg.DagsterInstance, n: int) -> None:
    for asset, ups in UPSTREAM.items():
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset, partition="00000" if asset == "hidden_state_shards" else None,
            metadata={"path": f"{asset}/x"}, tags=_tags(instance, ups, f"{asset}-v1")))
    tags = _tags(instance, BENCH_UPSTREAM, "")
    rng = random.Random(0)
    for i in range(n):
        add_result(instance, tags, 2.0 + rng.uniform(-0.02, 0.02), f"r{i}")


def add_result(instance: dg.DagsterInstance, tags: dict, acceptance_length: float, version: str) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "serving_benchmark", partition="vllm", tags={**tags, "dagster/data_version": version},
        metadata={"engine": "vllm", "engine_version": "0.0", "acceptance_length": acceptance_length, "speedup": 1.5,
                  "num_speculative_tokens": 3, "prompt_set": "eval", "max_new_tokens": 64}))


def tick_before(instance: dg.DagsterInstance, cursor: str | None) -> tuple[list[str], str]:
    """The regression sensor's tick up to 0015a8b, verbatim but for returning its run keys and cursor
    (and not building the requests' configs)."""
    cursor = json.loads(cursor) if cursor else {"bench": 0, "checks": 0}
    records = lineage.benchmark_records(instance)
    rows = [lineage.history_row(instance, r) for r in records]
    keys = []
    for row in rows:
        if row["storage_id"] <= cursor["bench"]:
            continue
        cursor["bench"] = max(cursor["bench"], row["storage_id"])
        if regressions(rows, row) is not None:
            keys.append(f"drop-{row['storage_id']}")
    for check_id, _target, _why in _failed_checks(instance, cursor["checks"]):
        cursor["checks"] = max(cursor["checks"], check_id)
    return keys, json.dumps(cursor)


def tick_after(instance: dg.DagsterInstance, cursor: str | None):
    data = benchmark_regression_sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=cursor))
    return [r.run_key for r in data.run_requests], data.cursor


def timed(fn, instance, cursor, walks: list[int]) -> dict:
    """Wall and CPU seconds of one tick, the lineage walks it made, its run keys; and its cursor."""
    n, wall, cpu = len(walks), time.perf_counter(), time.process_time()
    keys, cursor = fn(instance, cursor)
    return {"wall_s": round(time.perf_counter() - wall, 4), "cpu_s": round(time.process_time() - cpu, 4),
            "lineage_walks": len(walks) - n, "run_keys": keys}, cursor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=int, default=10_000)
    ap.add_argument("--out", type=Path, default=OUT)
    ns = ap.parse_args()
    walks: list[int] = []
    chain = lineage.chain

    def counted(instance, rec):  # one lineage walk (a result and everything upstream of it), counted
        walks.append(rec.storage_id)
        return chain(instance, rec)

    lineage.chain = counted
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as d, dg.DagsterInstance.local_temp(d) as inst:
        t0 = time.perf_counter()
        fill(inst, ns.results)
        fill_s = time.perf_counter() - t0
        first, cursor = timed(tick_after, inst, None, walks)
        latest = inst.fetch_materializations(lineage.BENCHMARK, limit=1).records[0].storage_id
        old_cursor = json.dumps({"bench": latest, "checks": 0})  # the old sensor's cursor, as of the same results
        idle, cursor = timed(tick_after, inst, cursor, walks)
        add_result(inst, _tags(inst, BENCH_UPSTREAM, ""), 1.5, "drop")  # a drop: one report either way
        before, _ = timed(tick_before, inst, old_cursor, walks)
        after, cursor = timed(tick_after, inst, cursor, walks)
    out = {"results": ns.results, "cpu": cpu_model(), "cores": os.cpu_count(), "fill_s": round(fill_s, 1),
           "before_one_new_result": before, "after_one_new_result": after, "after_no_new_result": idle,
           "after_first_tick_without_cursor": first, "cursor_bytes": len(cursor or ""),
           "storage": "SQLite (DagsterInstance.local_temp) on " + (str(shm) if shm.is_dir() else "the temp dir"),
           "note": "results reported outside runs, so reading a result's settings finds no run record to read "
                   "(a real result's run adds one run read per new result, after; one per result per "
                   "lineage walk, before)"}
    print(json.dumps(out, indent=2))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
