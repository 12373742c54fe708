"""A shard whose host stopped answering goes to another host of the pool, one that can reach its inputs.

`shard_host_failover` watches the shard jobs' failed runs. When a run failed because its host did not answer
(the SSH host marks those failures `host_unreachable`; a stage that failed on a live host is left alone: running
it elsewhere would fail the same way), it asks for the same partition on the host with the fewest queued or
running runs among those that answer and can have the shard's inputs (hosts/pool.py `reachable`), tagged with
that host, through `extract_hidden_states_on_host` (a job whose partitions carry no host tag of their own, so
the request's tag is the one the run queue sees). Hosts a shard already failed on are not tried again."""

from __future__ import annotations

import dagster as dg

from .assets.executor import ONE_PROCESS
from .assets.hidden_states import shard_inputs
from .assets.partitions import shard_partitions
from .hosts import HOST_TAG, GpuHost, HostPool
from .hosts.pool import unreachable

FAILED_HOSTS_TAG = "eagle3/failed_hosts"  # the hosts this shard's earlier runs could not reach, comma-separated
FAILOVER_OF_TAG = "eagle3/failover_of"
ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
          dg.DagsterRunStatus.STARTED]

extract_on_host_job = dg.define_asset_job(
    "extract_hidden_states_on_host", selection=["hidden_state_shards"], partitions_def=shard_partitions,
    executor_def=ONE_PROCESS,
    description=f"one shard on the host its {HOST_TAG} tag names: the failover sensor's runs, or a shard sent to a "
                "chosen host by hand (add the tag in the launchpad)")


def _host_failure(instance: dg.DagsterInstance, run_id: str) -> bool:
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        data = record.dagster_event.step_failure_data
        if data.user_failure_data is not None and unreachable(data.user_failure_data.metadata or {}):
            return True
    return False


def failover_request(instance: dg.DagsterInstance, run: dg.DagsterRun, pool: HostPool) -> dg.RunRequest | dg.SkipReason:
    key, failed = run.tags.get("dagster/partition"), run.tags.get(HOST_TAG)
    if not key or not failed:
        return dg.SkipReason(f"run {run.run_id} has no shard partition or no {HOST_TAG} tag")
    if not _host_failure(instance, run.run_id):
        return dg.SkipReason(f"shard {key} failed on host {failed!r}, which answered: not moved (it would fail "
                             "the same way elsewhere); see the run's error")
    tried = [h for h in run.tags.get(FAILED_HOSTS_TAG, "").split(",") if h] + [failed]
    target = instance.get_latest_materialization_event(dg.AssetKey("target_model"))
    held = shard_inputs(target.asset_materialization.metadata["path"].value)
    why, options = [], []
    for name in pool.members():
        if name in tried:
            continue
        reason = pool.reachable(instance, name, held)
        if reason:
            why.append(reason)
            continue
        busy = instance.get_runs_count(dg.RunsFilter(tags={HOST_TAG: name}, statuses=ACTIVE))
        options.append((busy, name))
    if not options:
        return dg.SkipReason(f"shard {key} failed because host {failed!r} did not answer, and no other host can "
                             f"take it: {'; '.join(why) or 'the pool has no other host'}")
    host = min(options)[1]
    return dg.RunRequest(run_key=f"failover-{run.run_id}", partition_key=key,
                         tags={HOST_TAG: host, FAILOVER_OF_TAG: run.run_id, FAILED_HOSTS_TAG: ",".join(tried)})


def build_failover_sensor(watched: list) -> dg.SensorDefinition:
    @dg.run_failure_sensor(name="shard_host_failover", monitored_jobs=[*watched, extract_on_host_job],
                           request_job=extract_on_host_job, minimum_interval_seconds=5,
                           default_status=dg.DefaultSensorStatus.RUNNING,
                           description="moves a shard whose host stopped answering to another host that can reach "
                                       "its inputs")
    def shard_host_failover(context: dg.RunFailureSensorContext, gpu_host: GpuHost):
        if not isinstance(gpu_host, HostPool):
            return dg.SkipReason("one host: nowhere else to run")
        out = failover_request(context.instance, context.dagster_run, gpu_host)
        if isinstance(out, dg.RunRequest):
            context.log.info(f"shard {out.partition_key}: host {context.dagster_run.tags.get(HOST_TAG)!r} did not "
                             f"answer; relaunched on {out.tags[HOST_TAG]!r}")
        return out

    return shard_host_failover
