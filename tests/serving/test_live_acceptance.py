"""The serving eye's live acceptance, from a real vLLM server serving a trained drafter as "production": bounded
load sent to it on 127.0.0.1, its real /metrics read by the real Dagster daemon's sensor into observations; the
server stopped (an observation says so) and started again (a new window)."""

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest
import yaml

from conftest import TINY_TRAIN
from daemon_harness import ROOT, start_daemon, stop_daemon
from eagle3_assets.common import spec_counters
from eagle3_assets.live_acceptance import asset_key
from eagle3_assets.worker.engines import vllm
from eagle3_assets.worker.engines.server import EngineServer, free_port

pytestmark = pytest.mark.slow
PROMPTS = ["Write a haiku about the sea.", "Explain what a hash map is.", "List three prime numbers.",
           "What is the capital of France?", "Give me a tip for learning to cook.", "Describe a cat in one line."]


def _server(target: str, drafter: str, port: int, log: Path) -> EngineServer:
    argv = vllm.server_command(sys.executable, target, port, drafter=drafter, k=3, dtype="float32",
                               max_model_len=1024, seed=0, extra=["--enforce-eager"])
    return EngineServer("production", argv, port, log, env=vllm.SERVER_ENV)


def _load(url: str, n: int, max_tokens: int = 24) -> None:
    """A bounded load generator: n completions, one at a time, to the server on 127.0.0.1."""
    for i in range(n):
        body = json.dumps({"model": "target", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200


def _counters(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return spec_counters.vllm_counters(r.read().decode())


@pytest.fixture(scope="module")
def production(built, tmp_path_factory):
    """The shared graph's drafter, trained briefly and exported, served by vLLM as a production server would."""
    built.materialize("eagle3_drafter", "drafter_export",
                      config={"eagle3_drafter": {"config": {**TINY_TRAIN, "run_name": "live"}}})
    vllm_dir = built.latest("drafter_export")["vllm_path"]
    root = tmp_path_factory.mktemp("live")
    srv = _server(built.latest("target_model")["path"], vllm_dir, free_port(), root / "server.log")
    with srv:
        srv.wait_ready(600)
        yield srv, vllm_dir, root


class Daemon:
    """The real dagster-daemon on a fresh instance, with the servers file in its environment."""

    def __init__(self, root: Path, servers_file: Path):
        self.home = root / "dagster_home"
        self.home.mkdir(exist_ok=True)
        (self.home / "dagster.yaml").write_text((ROOT / "dagster_home" / "dagster.yaml").read_text())
        env = {**os.environ, "DAGSTER_HOME": str(self.home), "EAGLE3_SERVERS": str(servers_file)}
        self.proc = start_daemon(env, root / "daemon.log")
        self.instance = dg.DagsterInstance.from_config(str(self.home))

    def observations(self, name: str) -> list[dict]:
        recs = self.instance.fetch_observations(asset_key(name), limit=1000).records
        out = [{k: v.value for k, v in r.event_log_entry.asset_observation.metadata.items()} for r in recs]
        return out[::-1]  # oldest first

    def wait(self, name: str, pred, timeout: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            obs = self.observations(name)
            if pred(obs):
                return obs
            time.sleep(1)
        raise AssertionError(f"timed out waiting for {what}; observations: {self.observations(name)[-5:]}")

    def stop(self):
        stop_daemon(self.proc)


def test_live_acceptance_from_a_real_server_through_load_a_stop_and_a_restart(production, built):
    srv, drafter, root = production
    servers = root / "servers.yaml"
    servers.write_text(yaml.safe_dump({"interval_s": 5, "servers": [
        {"name": "prod", "url": srv.base_url, "engine": "vllm", "drafter": drafter}]}))
    daemon = Daemon(root, servers)
    try:
        first = daemon.wait("prod", lambda o: len(o) >= 1, 180, "the sensor's first read")
        assert first[0]["drafter"] == drafter and first[0]["drafter_from"] == "config"
        before = _counters(srv.base_url)
        _load(srv.base_url, 6)
        after = _counters(srv.base_url)
        assert after["num_drafts"] > before["num_drafts"], "the load must make speculative steps"
        obs = daemon.wait("prod", lambda o: sum(x.get("num_drafts", 0) for x in o[1:]) >= after["num_drafts"]
                          - before["num_drafts"], 120, "the load's drafts in the observations")
        busy = [x for x in obs[1:] if x.get("num_drafts")]
        assert busy and all(x["status"] == "ok" for x in busy)
        for x in busy:  # each window as the server's own counters define it
            assert abs(x["acceptance_length"] - (1 + x["num_accepted_tokens"] / x["num_drafts"])) < 1e-3
            per_pos = json.loads(x["acceptance_per_pos"])
            assert len(per_pos) == 3 and all(0 <= p <= 1 for p in per_pos)
            assert 1 <= x["acceptance_length"] <= 4
        window = spec_counters.window(before, after)
        drafts = sum(x["num_drafts"] for x in busy)
        assert drafts == window["num_drafts"], "the windows add up to what the server counted, nothing twice"
        daemon.wait("prod", lambda o: o[-1]["status"].startswith("idle"), 60, "an idle window once the load ends")

        srv.stop()  # the server goes away: an observation says so, and the sensor goes on
        down = daemon.wait("prod", lambda o: o[-1]["status"].startswith("unreachable"), 60, "an unreachable read")
        assert "acceptance_length" not in down[-1]
        restarted = _server(built.latest("target_model")["path"], drafter, srv.port, root / "server-2.log")
        with restarted:
            restarted.wait_ready(600)
            _load(restarted.base_url, 2)
            fresh = _counters(restarted.base_url)
            obs = daemon.wait("prod", lambda o: any(x["status"].startswith("restarted") for x in o), 120,
                              "the restart seen as counters that went back")
            new = next(x for x in obs if x["status"].startswith("restarted"))
            assert new["num_drafts"] <= fresh["num_drafts"], "the new window counts from the restart, not the past"
            assert new.get("num_drafts", 0) > 0
    finally:
        daemon.stop()
