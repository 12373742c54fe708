"""The code location: assets, jobs and the gpu_host resource."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from .assets import all_assets
from .assets.partitions import shard_partitions
from .hosts import LocalGpuHost

PREPARE_DATA = ["target_model", "prompts", "conversations", "vocab_mapping"]
TRAIN_DRAFTER = ["eagle3_drafter", "drafter_export", "offline_acceptance"]


def default_host_workdir() -> str:
    """Where the local host keeps its artifacts: $EAGLE3_HOST_WORKDIR, else beside the instance storage."""
    if os.environ.get("EAGLE3_HOST_WORKDIR"):
        return os.environ["EAGLE3_HOST_WORKDIR"]
    home = os.environ.get("DAGSTER_HOME") or str(Path.cwd() / "dagster_home")
    return str(Path(home) / "host-work")


prepare_data_job = dg.define_asset_job(
    "prepare_data", selection=PREPARE_DATA,
    description="target model, prompts, regenerated conversations and the draft vocab (registers the shards)")
extract_hidden_states_job = dg.define_asset_job(
    "extract_hidden_states", selection=["hidden_state_shards"], partitions_def=shard_partitions,
    description="one hidden-state shard per run; launch a backfill over all partitions for the whole set")
train_drafter_job = dg.define_asset_job(
    "train_drafter", selection=TRAIN_DRAFTER,
    description="train the drafter on all shards, export it for vLLM and SGLang, measure offline acceptance")

defs = dg.Definitions(
    assets=all_assets,
    jobs=[prepare_data_job, extract_hidden_states_job, train_drafter_job],
    resources={"gpu_host": LocalGpuHost(workdir=default_host_workdir())},
)
