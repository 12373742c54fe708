"""A pool of two hosts, each a real OpenSSH server on 127.0.0.1 with its own work directory, driven the way a
team drives it: a real Dagster instance with the shipped run-queue limits, the real daemon (run queue, the
failover sensor), a backfill launched with Dagster's own CLI. Shards spread over the hosts, one at a time per
host; training on the first host pulls the other's shards; a host that stops answering mid-backfill fails its
shard naming it, and the sensor moves that shard to the host that still answers."""

from __future__ import annotations

import json
import os
import signal

import dagster as dg
import pytest

from conftest import TINY_TRAIN, failure_text
from eagle3_assets.failover import FAILED_HOSTS_TAG, FAILOVER_OF_TAG
from eagle3_assets.hosts import HOST_TAG
from pool_harness import PREPARE, TERMINAL, Pool, host_timeline

pytestmark = pytest.mark.slow  # a daemon and run workers that each load the code location


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from ssh_server import SshServer

    root = tmp_path_factory.mktemp("pool")
    servers = {name: SshServer(root / f"sshd-{name}").start() for name in ("a", "b")}
    p = Pool(root, servers)
    try:
        res = p.materialize(*PREPARE)
        assert res.success, failure_text(res)
        assert p.instance.get_dynamic_partitions("hidden_state_shards") == ["00000", "00001", "00002", "00003"]
        p.start_daemon()
        yield p
    finally:
        p.stop_daemon()
        for s in servers.values():
            s.stop()


def test_backfill_spreads_over_two_hosts_one_at_a_time_and_training_reads_all(pool):
    t0 = pool.backfill()
    runs = pool.wait(lambda: (rs := pool.runs_since(t0, "extract_hidden_states")) and len(rs) == 4
                     and all(r.dagster_run.status in TERMINAL for r in rs) and rs, 600, "the backfill's 4 runs")
    assert all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in runs), \
        [(r.dagster_run.run_id, r.dagster_run.status) for r in runs]
    timeline = host_timeline(runs)
    print("backfill timeline (host: start, end, shard):", json.dumps(
        {h: [(round(s - t0, 1), round(e - t0, 1), k) for s, e, k in v] for h, v in timeline.items()}))
    assert {h: sorted(k for _, _, k in v) for h, v in timeline.items()} == \
        {"a": ["00000", "00002"], "b": ["00001", "00003"]}, "shard i on host i mod 2"
    for host, spans in timeline.items():
        for (s1, e1, k1), (s2, _, k2) in zip(spans, spans[1:]):
            assert e1 <= s2, f"host {host} ran shards {k1} and {k2} at once ({s1}-{e1} and {s2}-)"
    (a_start, a_end, _), (b_start, b_end, _) = timeline["a"][0], timeline["b"][0]
    assert a_start < b_end and b_start < a_end, "the two hosts worked at the same time"
    for key in ("00000", "00001", "00002", "00003"):
        meta = pool.latest_shard(key)
        host = "a" if int(key) % 2 == 0 else "b"
        assert meta["host"] == host, meta
        assert (pool.workdirs[host] / "hidden_states" / f"shard-{key}" / "manifest.json").exists()
    # host b got the conversations and the embedded target copied from a, once
    assert json.loads((pool.workdirs["b"] / "conversations" / ".conversations.parquet.replica.json").read_text())["from"] == "a"

    res = pool.materialize("eagle3_drafter", config={"eagle3_drafter": {"config": {**TINY_TRAIN, "run_name": "pool"}}})
    assert res.success, failure_text(res)
    messages = [r.user_message for r in pool.instance.all_logs(res.run_id) if r.dagster_event is None]
    for key in ("00001", "00003"):  # b's shards were copied to a, where training ran
        assert any(m.startswith(f"copied hidden_states/shard-{key} from b") for m in messages), messages
        assert (pool.workdirs["a"] / "hidden_states" / f"shard-{key}" / "manifest.json").exists()
    drafter = {k: v.value for k, v in pool.instance.get_latest_materialization_event(
        dg.AssetKey("eagle3_drafter")).asset_materialization.metadata.items()}
    assert drafter["host"] == "a"
    tokens = sum(int(pool.latest_shard(k)["tokens"]) for k in ("00000", "00001", "00002", "00003"))
    assert drafter["train_tokens_per_epoch"] == tokens, (drafter["train_tokens_per_epoch"], tokens)


def test_host_that_stops_answering_mid_backfill_fails_its_shard_and_the_rest_complete(pool):
    b = pool.servers["b"]
    t0 = pool.backfill()

    def b_job_running():
        for d in (pool.workdirs["b"] / ".eagle3" / "jobs").glob("hidden_state_shards@*"):
            state = d / "state.json"
            if d.suffix == "" and state.exists() and state.stat().st_mtime >= t0:
                return d
    rundir = pool.wait(b_job_running, 300, "a shard's job on host b")
    # host b goes away: its sshd and the job it was running (both started by this test)
    pgid = json.loads((rundir / "state.json").read_text()).get("pgid")
    b.cut_connections()
    b.stop()
    if pgid:
        try:
            os.killpg(int(pgid), signal.SIGKILL)
        except ProcessLookupError:
            pass

    def settled():
        rs = pool.runs_since(t0)
        done = {}
        for r in rs:
            if r.dagster_run.status == dg.DagsterRunStatus.SUCCESS:
                done[r.dagster_run.tags["dagster/partition"]] = r
        return len(done) == 4 and all(r.dagster_run.status in TERMINAL for r in rs) and rs
    runs = pool.wait(settled, 600, "every shard materialized again")
    failed = [r for r in runs if r.dagster_run.status == dg.DagsterRunStatus.FAILURE]
    assert failed and all(r.dagster_run.tags[HOST_TAG] == "b" for r in failed), \
        [(r.dagster_run.tags, r.dagster_run.status) for r in runs]
    for r in failed:
        errors = [e for e in pool.instance.all_logs(r.dagster_run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)]
        text = " ".join(e.dagster_event.step_failure_data.user_failure_data.description or "" for e in errors)
        assert "host 'b'" in text and str(b.port) in text, text
    moved = [r for r in runs if r.dagster_run.tags.get(FAILOVER_OF_TAG)]
    assert sorted(r.dagster_run.tags["dagster/partition"] for r in moved) == \
        sorted(r.dagster_run.tags["dagster/partition"] for r in failed)
    assert all(r.dagster_run.tags[HOST_TAG] == "a" and r.dagster_run.tags[FAILED_HOSTS_TAG] == "b" for r in moved)
    for key in ("00000", "00001", "00002", "00003"):
        meta = pool.latest_shard(key)
        assert meta["host"] == "a", (key, meta)
        assert meta["run_id"] in {r.dagster_run.run_id for r in runs}
    # the killed job published nothing: b's shards are the complete ones of the first backfill
    for shard in (pool.workdirs["b"] / "hidden_states").glob("shard-*"):
        assert (shard / "manifest.json").stat().st_mtime < t0, f"{shard} was published after host b was stopped"
