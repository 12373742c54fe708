"""The README's main command on the embedded default, its lineage in DAGSTER_HOME, and the UI's view of it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import requests

pytestmark = pytest.mark.slow  # the whole main command, vLLM included
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 3600
TINY_YAML = """
ops:
  prompts: {config: {max_train_conversations: 4}}
  synthetic_prompts: {config: {count: 2, chunk_size: 4, batch_size: 4, max_new_tokens: 48}}
  conversations: {config: {max_new_tokens: 8, samples_per_shard: 2, extra_args: [--enforce-eager]}}
  vocab_mapping: {config: {draft_vocab_size: 128}}
  eagle3_drafter: {config: {epochs: 1, ttt_steps: 2, row_tokens: 256, rows_per_batch: 1}}
  offline_acceptance: {config: {limit: 2, max_new_tokens: 8}}
  speculation_schedule: {config: {concurrencies: [1, 4], num_speculative_tokens: 1, max_new_tokens: 8,
                                  rounds: 3, dtype: float32, max_model_len: 1024,
                                  extra_args: [--enforce-eager]}}
  serving_benchmark: {config: {limit: 2, max_new_tokens: 8, concurrencies: [1], baseline: false, dtype: float32,
                               max_model_len: 1024, extra_args: [--enforce-eager]}}
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A dagster_home like the repo's, after one `eagle3-assets materialize` run."""
    home = tmp_path_factory.mktemp("home")
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    cfg = home / "tiny.yaml"
    cfg.write_text(TINY_YAML)
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_NO_BAR": "1"}
    env.pop("EAGLE3_HOST_WORKDIR", None)
    cli = Path(sys.executable).with_name("eagle3-assets")
    # with a deadline, as the command without --config runs: training's budget is set from what is left
    done = subprocess.run([str(cli), "materialize", "--config", str(cfg), "--deadline", str(DEADLINE_S)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "==> done" in done.stdout and f"(deadline {DEADLINE_S} s)" in done.stdout
    assert "==> training time budget" in done.stdout
    assert "==> speculation schedule vllm: 1-" in done.stdout  # measured and shipped, its headline printed
    return home


def test_main_command_materializes_everything_into_dagster_home(home):
    with dg.DagsterInstance.from_config(str(home)) as inst:
        for name in ("host_preflight", "target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping",
                     "eagle3_drafter",
                     "drafter_export", "offline_acceptance"):
            assert inst.get_latest_materialization_event(dg.AssetKey(name)) is not None, name
        # 4 human prompts and the 2 the target wrote, 2 conversations a shard
        syn = inst.get_latest_materialization_event(dg.AssetKey("synthetic_prompts")).asset_materialization.metadata
        assert syn["prompts"].value == 2
        keys = inst.get_dynamic_partitions("hidden_state_shards")
        assert keys == ["00000", "00001", "00002"]
        done = inst.get_materialized_partitions(dg.AssetKey("hidden_state_shards"))
        assert done == set(keys)
        # lineage: the shards were built from exactly this target's weights and these conversations
        tv = inst.get_latest_materialization_event(dg.AssetKey("target_model")).asset_materialization.tags
        rec = inst.fetch_materializations(dg.AssetKey("hidden_state_shards"), limit=1).records[0]
        tags = rec.event_log_entry.asset_materialization.tags
        assert tags["dagster/input_data_version/target_model"] == tv["dagster/data_version"]
        # ... and the acceptance result names the exact drafter checkpoint it measured
        dv = inst.get_latest_materialization_event(dg.AssetKey("eagle3_drafter")).asset_materialization.tags
        acc = inst.get_latest_materialization_event(dg.AssetKey("offline_acceptance")).asset_materialization
        assert acc.tags["dagster/input_data_version/eagle3_drafter"] == dv["dagster/data_version"]
        assert acc.metadata["output_matches_target_greedy"].value is True
        # the deadline reached the train stage: a budget under the time the command had left
        trained = inst.get_latest_materialization_event(dg.AssetKey("eagle3_drafter")).asset_materialization.metadata
        assert 0 < trained["time_budget_s"].value < DEADLINE_S
        # ... and so does the engine benchmark, through the export
        bench = inst.fetch_materializations(dg.AssetKey("serving_benchmark"), limit=1).records[0].event_log_entry
        assert bench.asset_materialization.partition == "vllm"
        assert bench.asset_materialization.metadata["checkpoint"].value == dv["dagster/data_version"]
        assert bench.asset_materialization.metadata["acceptance_length"].value >= 1.0
    assert (home / "host-work" / "hidden_states" / "shard-00001" / "manifest.json").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_ui_serves_the_graph_and_the_first_runs(home):
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    web = shutil.which("dagster-webserver", path=str(Path(sys.executable).parent))
    proc = subprocess.Popen([web, "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/graphql"
        query = "{ assetNodes { assetKey { path } groupName } runsOrError { ... on Runs { results { runId status } } } }"
        deadline, data = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            try:
                data = requests.post(url, json={"query": query}, timeout=10).json()["data"]
                if data["assetNodes"]:
                    break
            except (requests.ConnectionError, KeyError, TypeError):
                pass
            time.sleep(1)
        assert data and data["assetNodes"], "the webserver did not load the code location"
        nodes = {n["assetKey"]["path"][0]: n["groupName"] for n in data["assetNodes"]}
        assert nodes == {**{a: "data" for a in ("target_model", "prompts", "synthetic_prompts", "conversations",
                                                 "hidden_state_shards", "vocab_mapping")},
                         **{a: "drafter" for a in ("eagle3_drafter", "drafter_export", "offline_acceptance")},
                         "host_preflight": "host",
                         **{a: "integration" for a in ("integration_drafter", "integration_check")},
                         **{a: "serving" for a in ("speculation_schedule", "serving_benchmark", "benchmark_history",
                                                   "benchmark_regression",
                                                   "traffic", "traffic_acceptance", "drift_report")},
                         **{a: "loop" for a in ("retrain_data", "retrain_conversations", "retrain_shards",
                                                "challenger_drafter", "challenger_export", "promotion_gate",
                                                "challenger_schedule", "production_drafter", "rollout")}}
        runs = data["runsOrError"]["results"]
        # check_host, prepare_data (synthetic_prompts among them), 3 shards, train_drafter, measure_schedule and
        # benchmark_serving (vllm)
        assert len(runs) == 8 and all(r["status"] == "SUCCESS" for r in runs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
