"""A job the SSH tests re-execute the way Dagster's run retries do: importable (reconstructable), in-process
(so killing the run's process kills its step), its host configured from environment variables."""

import dagster as dg

from eagle3_assets.assets.partitions import shard_partitions
from eagle3_assets.definitions import all_assets
from eagle3_assets.hosts import SshGpuHost


def ssh_host_from_env() -> SshGpuHost:
    return SshGpuHost(host="127.0.0.1", port=dg.EnvVar.int("T_SSH_PORT"), user=dg.EnvVar("T_SSH_USER"),
                      key_file=dg.EnvVar("T_SSH_KEY"), known_hosts=dg.EnvVar("T_SSH_KNOWN_HOSTS"),
                      python=dg.EnvVar("T_SSH_PYTHON"), workdir=dg.EnvVar("T_SSH_WORKDIR"), require_gpus=False,
                      min_free_gb=0.1)


def ssh_extract_job() -> dg.JobDefinition:
    job = dg.define_asset_job("ssh_extract", selection=["hidden_state_shards"], partitions_def=shard_partitions,
                              executor_def=dg.in_process_executor)
    defs = dg.Definitions(assets=all_assets, jobs=[job], resources={"gpu_host": ssh_host_from_env()})
    return defs.resolve_job_def("ssh_extract")


def ssh_target_job() -> dg.JobDefinition:
    job = dg.define_asset_job("ssh_target", selection=["target_model"], executor_def=dg.in_process_executor)
    defs = dg.Definitions(assets=all_assets, jobs=[job], resources={"gpu_host": ssh_host_from_env()})
    return defs.resolve_job_def("ssh_target")
