"""A pool of real hosts driven the way a team drives it: a Dagster instance with the shipped run-queue limits,
the real daemon, a backfill launched with Dagster's own CLI, each host a real OpenSSH server on 127.0.0.1 with
its own work directory. Used by tests/hosts/test_host_pool.py and bench/backfill_hosts.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import yaml

from conftest import TINY
from daemon_harness import start_daemon, stop_daemon
from eagle3_assets.definitions import all_assets
from eagle3_assets.hosts import HOST_TAG, HostPool

ROOT = Path(__file__).resolve().parents[1]
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
        self.daemon = start_daemon(self.env, self.root / "daemon.log")

    def stop_daemon(self) -> None:
        stop_daemon(self.daemon)

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


def host_timeline(records: list[dg.RunRecord]) -> dict[str, list[tuple[float, float, str]]]:
    by_host: dict[str, list] = {}
    for r in records:
        by_host.setdefault(r.dagster_run.tags[HOST_TAG], []).append(
            (r.start_time, r.end_time, r.dagster_run.tags["dagster/partition"]))
    return {h: sorted(v) for h, v in by_host.items()}


