"""A pool of two hosts, each a real OpenSSH server on 127.0.0.1 with its own work directory, driven the way a
team drives it: a real Dagster instance with the shipped run-queue limits, the real daemon (run queue, the
failover sensor), a backfill launched with Dagster's own CLI. Shards spread over the hosts, one at a time per
host; training on the first host pulls the other's shards; a host that stops answering mid-backfill fails its
shard naming it, and the sensor moves that shard to the host that still answers. A hosts file a user got wrong
is refused as the code location loads, naming the file, EAGLE3_HOSTS and the line."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import dagster as dg
import pytest
import yaml

from conftest import TINY_TRAIN, failure_text
from eagle3_assets.failover import FAILED_HOSTS_TAG, FAILOVER_OF_TAG
from eagle3_assets.hosts import HOST_TAG
from eagle3_assets.hosts.pool import HOSTS_ENV
from pool_harness import PREPARE, TERMINAL, Pool, host_timeline


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


@pytest.mark.slow  # a daemon and run workers that each load the code location
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
    # some run on a overlapped some run on b (which pair depends on how fast each run worker starts:
    # b's first run also copies the conversations and the target from a)
    assert any(sa < eb and sb < ea for sa, ea, _ in timeline["a"] for sb, eb, _ in timeline["b"]), \
        "the two hosts worked at the same time"
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


@pytest.mark.slow
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


def _load_from_env(monkeypatch, path: Path):
    """What the code location does with EAGLE3_HOSTS as it loads, then as a run starts (each host built)."""
    from eagle3_assets.definitions import gpu_host_from_env

    monkeypatch.setenv(HOSTS_ENV, str(path))
    return gpu_host_from_env().members()


GOOD = {"name": "a", "kind": "local", "workdir": "/tmp/eagle3-a", "require_gpus": False}


def test_invalid_yaml_in_the_hosts_file_names_the_file_the_variable_and_the_line(tmp_path, monkeypatch):
    path = tmp_path / "hosts.yaml"
    path.write_text("hosts:\n  - name: a\n    kind: [local\n    workdir: /tmp/eagle3-a\n")
    with pytest.raises(ValueError) as e:
        _load_from_env(monkeypatch, path)
    msg = str(e.value)
    assert f"hosts file {path} ({HOSTS_ENV}) is not valid YAML: line 4, column 12" in msg, msg
    assert "flow sequence, line 3, column 11" in msg and "<unicode string>" not in msg, msg


@pytest.mark.parametrize("content, says", [
    (b"hosts:\n  - {name: a, kind: local, workdir: /tmp/x}\n  - name: b\n    kind: sssh\n",
     "line 4: host 'b': kind 'sssh' is not one of"),
    (yaml.safe_dump({"hosts": [GOOD, {**GOOD, "name": "b", "require_gpus": "perhaps"}]}).encode(),
     "line 8: host 'b' (local): require_gpus: Input should be a valid boolean"),
    (yaml.safe_dump({"hosts": [{**GOOD, "workdir": {"env": "EAGLE3_TEST_UNSET_VAR"}}]}).encode(),
     "host 'a': workdir is read from $EAGLE3_TEST_UNSET_VAR, which is not set"),
    (yaml.safe_dump({"hosts": [{**GOOD, 7: "x"}]}).encode(), "line 2: host 'a': 7 is not a setting's name"),
    (b"hosts:\n  - name: caf\xe9\n", "is not UTF-8 text (byte 20)"),
    (b"hosts:\n  - name: a\x07\n", "is not valid YAML: line 2"),
    (None, "cannot be read: Is a directory"),
])
def test_every_hosts_file_error_names_the_file_and_the_variable(tmp_path, monkeypatch, content, says):
    path = tmp_path / "hosts.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    monkeypatch.delenv("EAGLE3_TEST_UNSET_VAR", raising=False)
    with pytest.raises(ValueError) as e:
        _load_from_env(monkeypatch, path)
    assert f"hosts file {path} ({HOSTS_ENV})" in str(e.value) and says in str(e.value), str(e.value)


def test_a_hosts_file_gone_when_a_run_starts_is_named(tmp_path):
    from eagle3_assets.hosts import HostPool

    with pytest.raises(ValueError, match=f"hosts file {tmp_path / 'gone.yaml'}: no such file"):
        HostPool(hosts_file=str(tmp_path / "gone.yaml")).members()
