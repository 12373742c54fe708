"""A pool of two hosts, each a real OpenSSH server on 127.0.0.1 with its own work directory, driven the way a
team drives it: a real Dagster instance with the shipped run-queue limits, the real daemon (run queue, the
failover sensor), a backfill launched with Dagster's own CLI. Shards spread over the hosts, one at a time per
host; training on the first host pulls the other's shards; a host that stops answering mid-backfill fails its
shard naming it, and the sensor moves that shard to the host that still answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from conftest import TINY, TINY_TRAIN, failure_text
from eagle3_assets.assets import all_assets
from eagle3_assets.failover import FAILED_HOSTS_TAG, FAILOVER_OF_TAG
from eagle3_assets.hosts import HOST_TAG, HostPool

pytestmark = pytest.mark.slow  # a daemon and run workers that each load the code location

ROOT = Path(__file__).resolve().parents[2]
PREPARE = ["target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping"]
FOUR_SHARDS = {**TINY, "prompts": {"config": {"max_train_conversations": 8}},
               "conversations": {"config": {**TINY["conversations"]["config"], "samples_per_shard": 2}}}
TERMINAL = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


class Pool:
    def __init__(self, root: Path, servers: dict):
        self.root, self.servers = root, servers
        self.workdirs = {name: root / f"work-{name}" for name in servers}
        self.hosts_file = root / "hosts.yaml"
        self.hosts_file.write_text(yaml.safe_dump({"hosts": [
            {"name": name, "kind": "ssh", "host": "127.0.0.1", "port": s.port, "user": s.user,
             "key_file": str(s.client_key), "known_hosts": str(s.known_hosts), "python": sys.executable,
             "workdir": str(self.workdirs[name]), "require_gpus": False, "min_free_gb": 0.1,
             "reconnect_within_s": 3, "connect_timeout_s": 5} for name, s in servers.items()]}))
        self.home = root / "dagster_home"
        self.home.mkdir()
        shipped = yaml.safe_load((ROOT / "dagster_home" / "dagster.yaml").read_text())
        shipped["concurrency"]["pools"]["default_limit"] = len(servers)  # the README's step for H hosts
        (self.home / "dagster.yaml").write_text(yaml.safe_dump(shipped))
        self.env = {**os.environ, "DAGSTER_HOME": str(self.home), "EAGLE3_HOSTS": str(self.hosts_file),
                    "EAGLE3_NO_BAR": "1"}
        self.instance = dg.DagsterInstance.from_config(str(self.home))
        self.resource = HostPool(hosts_file=str(self.hosts_file))
        self.daemon: subprocess.Popen | None = None

    def materialize(self, *names: str, config: dict | None = None):
        ops = {n: (config or FOUR_SHARDS).get(n, {}) for n in names}
        return dg.materialize(all_assets, selection=list(names), instance=self.instance,
                              resources={"gpu_host": self.resource}, run_config={"ops": {k: v for k, v in ops.items() if v}})

    def start_daemon(self) -> None:
        self.daemon = subprocess.Popen(["dagster-daemon", "run", "-w", str(ROOT / "workspace.yaml")], cwd=ROOT,
                                       env=self.env, start_new_session=True, stdout=open(self.root / "daemon.log", "ab"),
                                       stderr=subprocess.STDOUT)

    def stop_daemon(self) -> None:
        if self.daemon and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)  # its own process group: the daemon and its code server
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait()

    def backfill(self) -> float:
        t0 = time.time()
        out = subprocess.run(["dagster", "job", "backfill", "-w", str(ROOT / "workspace.yaml"), "-j",
                              "extract_hidden_states", "--all", "--noprompt"], cwd=ROOT, env=self.env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return t0

    def runs_since(self, t0: float, job: str | None = None) -> list[dg.RunRecord]:
        recs = self.instance.get_run_records(dg.RunsFilter(job_name=job) if job else None)
        return [r for r in recs if r.create_timestamp.timestamp() >= t0]

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            if self.daemon.poll() is not None:
                raise AssertionError(f"the daemon exited: {(self.root / 'daemon.log').read_text()[-3000:]}")
            time.sleep(1.0)
        raise AssertionError(f"timed out waiting for {what}; daemon log:\n"
                             f"{(self.root / 'daemon.log').read_text()[-3000:]}")

    def latest_shard(self, key: str) -> dict:
        rec = self.instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("hidden_state_shards"), asset_partitions=[key]), limit=1).records[0]
        return {"run_id": rec.run_id, **{k: v.value for k, v in rec.event_log_entry.asset_materialization.metadata.items()}}


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


def _host_timeline(records: list[dg.RunRecord]) -> dict[str, list[tuple[float, float, str]]]:
    by_host: dict[str, list] = {}
    for r in records:
        by_host.setdefault(r.dagster_run.tags[HOST_TAG], []).append(
            (r.start_time, r.end_time, r.dagster_run.tags["dagster/partition"]))
    return {h: sorted(v) for h, v in by_host.items()}


def test_backfill_spreads_over_two_hosts_one_at_a_time_and_training_reads_all(pool):
    t0 = pool.backfill()
    runs = pool.wait(lambda: (rs := pool.runs_since(t0, "extract_hidden_states")) and len(rs) == 4
                     and all(r.dagster_run.status in TERMINAL for r in rs) and rs, 600, "the backfill's 4 runs")
    assert all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in runs), \
        [(r.dagster_run.run_id, r.dagster_run.status) for r in runs]
    timeline = _host_timeline(runs)
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
