"""The code location: assets, jobs and the gpu_host resource."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import dagster as dg

from . import eye, loop
from .assets import pipeline_assets
from .assets.executor import ONE_PROCESS
from .assets.partitions import engine_partitions, shard_partitions
from .automation import benchmark_regression_sensor, nightly_rebenchmark, rebenchmark_job, regression_report_job
from .eye.servers_file import SERVERS_ENV, ServersFile, load_servers
from .failover import build_failover_sensor, extract_on_host_job
from .hosts import HOST_TAG, GpuHost, HostPool, K8sHost, LocalGpuHost, SshGpuHost
from .hosts.pool import HOSTS_ENV, home_host, host_names

# The whole graph as it stands with no production servers watched (tests and benches materialize from it)
all_assets = [*pipeline_assets, *eye.ASSETS, *loop.ASSETS]

PREPARE_DATA = ["target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping"]
TRAIN_DRAFTER = ["eagle3_drafter", "drafter_export", "offline_acceptance"]


def default_host_workdir() -> str:
    """Where the local host keeps its artifacts: $EAGLE3_HOST_WORKDIR, else beside the instance storage."""
    if os.environ.get("EAGLE3_HOST_WORKDIR"):
        return os.environ["EAGLE3_HOST_WORKDIR"]
    home = os.environ.get("DAGSTER_HOME") or str(Path.cwd() / "dagster_home")
    return str(Path(home) / "host-work")


# EAGLE3_SSH_<FIELD> -> SshGpuHost field. Values are dg.EnvVar, read when a run starts: secrets stay out of
# the code and the UI, and changing the host needs no code change.
SSH_ENV = {"HOST": "host", "PORT": "port", "USER": "user", "KEY_FILE": "key_file", "KEY_PASSPHRASE": "key_passphrase",
           "PASSWORD": "password", "KNOWN_HOSTS": "known_hosts", "PYTHON": "python", "WORKDIR": "workdir",
           "CODE": "code"}
SSH_FLAGS = {"REQUIRE_GPUS": "require_gpus", "ACCEPT_UNKNOWN_HOST_KEY": "accept_unknown_host_key"}
# EAGLE3_K8S_<FIELD> -> K8sHost field (EAGLE3_K8S_SECRETS: Secret names, comma-separated). Nothing here is
# secret (the secrets stay in the cluster), so the values are read as the code location loads. Node selectors and
# tolerations: a hosts file (EAGLE3_HOSTS).
K8S_ENV = {"IMAGE": "image", "NAMESPACE": "namespace", "PVC": "pvc", "WORKDIR": "workdir", "GPUS": "gpus",
           "PYTHON": "python", "SERVICE_ACCOUNT": "service_account", "KUBECONFIG": "kubeconfig",
           "KUBE_CONTEXT": "kube_context", "CONTROL_PLANE_MOUNT": "control_plane_mount"}


def gpu_host_from_env() -> GpuHost:
    """A pool of hosts when EAGLE3_HOSTS names their YAML file; the SSH host when EAGLE3_SSH_HOST is set
    (EAGLE3_SSH_WORKDIR too); a Kubernetes host when EAGLE3_K8S_IMAGE is; else this machine."""
    if os.environ.get(HOSTS_ENV):
        host_names(os.environ[HOSTS_ENV])  # a bad file fails the code location's load, naming what is wrong
        return HostPool(hosts_file=os.environ[HOSTS_ENV])
    if os.environ.get("EAGLE3_K8S_IMAGE"):
        if os.environ.get("EAGLE3_SSH_HOST"):
            raise ValueError("both EAGLE3_K8S_IMAGE and EAGLE3_SSH_HOST are set: unset one, or list both hosts in a "
                             f"hosts file ({HOSTS_ENV}; README: Several hosts)")
        fields = {f: os.environ[f"EAGLE3_K8S_{k}"] for k, f in K8S_ENV.items() if os.environ.get(f"EAGLE3_K8S_{k}")}
        secrets = [s.strip() for s in os.environ.get("EAGLE3_K8S_SECRETS", "").split(",") if s.strip()]
        return K8sHost(**fields, secrets=secrets)
    if not os.environ.get("EAGLE3_SSH_HOST"):
        return LocalGpuHost(workdir=default_host_workdir())
    if not os.environ.get("EAGLE3_SSH_WORKDIR"):
        raise ValueError("EAGLE3_SSH_HOST is set but EAGLE3_SSH_WORKDIR is not: set it to the work directory on the "
                         "GPU host (where models, shards and checkpoints live; it needs the disk)")
    fields = {f: (dg.EnvVar.int(f"EAGLE3_SSH_{k}") if f == "port" else dg.EnvVar(f"EAGLE3_SSH_{k}"))
              for k, f in SSH_ENV.items() if os.environ.get(f"EAGLE3_SSH_{k}")}
    fields.update({f: os.environ[f"EAGLE3_SSH_{k}"].lower() in ("1", "true", "yes")
                   for k, f in SSH_FLAGS.items() if os.environ.get(f"EAGLE3_SSH_{k}")})
    return SshGpuHost(**fields)


gpu_host = gpu_host_from_env()
# With a pool, every job's runs carry the host they use (the first, where unpartitioned work runs), and each
# shard's run the host it is spread to: the run queue keeps one run per host (dagster.yaml).
HOSTS = host_names(gpu_host.hosts_file) if isinstance(gpu_host, HostPool) else []
ON_PRIMARY = {HOST_TAG: HOSTS[0]} if HOSTS else {}
shard_config = dg.PartitionedConfig(
    partitions_def=shard_partitions, run_config_for_partition_key_fn=lambda key: {},
    tags_for_partition_key_fn=lambda key: {HOST_TAG: home_host(HOSTS, key)} if HOSTS else {})

check_host_job = dg.define_asset_job(
    "check_host", selection=["host_preflight"], tags=ON_PRIMARY,
    description="is the GPU host ready: Python and worker deps, worker code, GPUs, free disk for the hidden states")
prepare_data_job = dg.define_asset_job(
    "prepare_data", selection=PREPARE_DATA, tags=ON_PRIMARY,
    description="target model, prompts, the target's own prompts, regenerated conversations and the draft vocab "
                "(registers the shards)")
extract_hidden_states_job = dg.define_asset_job(
    "extract_hidden_states", selection=["hidden_state_shards"], partitions_def=shard_partitions, config=shard_config,
    executor_def=ONE_PROCESS,
    description="one hidden-state shard per run; launch a backfill over all partitions for the whole set (with a "
                "pool of hosts, shard i runs on host i mod H: each run's eagle3/host tag)")
train_drafter_job = dg.define_asset_job(
    "train_drafter", selection=TRAIN_DRAFTER, tags=ON_PRIMARY,
    description="train the drafter on all shards, export it for vLLM and SGLang, measure offline acceptance")

integration_gate_job = dg.define_asset_job(
    "integration_gate", selection=["integration_drafter", "integration_check"], partitions_def=engine_partitions,
    tags=ON_PRIMARY, description="before the full training: a drafter memorising a few extracted conversations, "
                                 "served by the engine (partition) on them; eagle3_drafter waits for it to pass")
measure_schedule_job = dg.define_asset_job(
    "measure_schedule", selection=["speculation_schedule"], partitions_def=engine_partitions, tags=ON_PRIMARY,
    description="the exported drafter's load curve on a real engine (partition): throughput per k at a grid of "
                "concurrencies, and the schedule by load chosen from it, written beside the export")
benchmark_serving_job = dg.define_asset_job(
    "benchmark_serving", selection=["serving_benchmark"], partitions_def=engine_partitions, tags=ON_PRIMARY,
    description="the exported drafter on a real engine (partition: an engine of worker/engines/) against the same server without "
                "speculation; checks acceptance against offline_acceptance")


def servers_from_env() -> tuple[ServersFile | None, str | None]:
    """The servers file (EAGLE3_SERVERS), or why it was refused: a bad file leaves the eye and the loop without
    servers, not the whole code location down (training and every other sensor still load)."""
    if not os.environ.get(SERVERS_ENV):
        return None, None
    try:
        return load_servers(os.environ[SERVERS_ENV]), None
    except ValueError as e:
        logging.getLogger("eagle3_assets").warning(f"the serving eye watches no server: {e}")
        return None, str(e)


# The pipeline here; the serving eye (EAGLE3_SERVERS: an asset per production server, its sensors and checks) and
# the loop each bring their own definitions, merged.
servers, servers_refused = servers_from_env()


def pipeline_definitions() -> dg.Definitions:
    """The pipeline's own part (a function: a code location has one Definitions object at module scope)."""
    return dg.Definitions(
        assets=pipeline_assets,
        jobs=[check_host_job, prepare_data_job, extract_hidden_states_job, extract_on_host_job, integration_gate_job,
              train_drafter_job, measure_schedule_job, benchmark_serving_job, rebenchmark_job, regression_report_job],
        schedules=[nightly_rebenchmark],
        sensors=[benchmark_regression_sensor, build_failover_sensor([extract_hidden_states_job])],
        resources={"gpu_host": gpu_host},
    )


defs = dg.Definitions.merge(pipeline_definitions(), eye.definitions(servers, servers_refused),
                            loop.definitions(servers))
