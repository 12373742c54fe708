"""rollout (group `loop`, per engine): the drafter in production put on the engine's running servers, one at a time,
each checked before the next; a server that fails is put back on its drafter and the rollout stops, naming it
(eagle3_assets/loop/restart.py says how, and why restarts)."""

import os
import time

import dagster as dg
from pydantic import Field

from ..assets.partitions import engine_partitions
from ..assets.speculation_schedule import schedule_for
from ..code_versions import code_version
from ..common.launch import SPEC_CONFIG
from ..eye import served
from ..eye.servers_file import SERVERS_ENV, load_servers
from . import production
from . import restart as servers_rollout

ROLLOUT = served.ROLLOUT


class RolloutConfig(dg.Config):
    verify_live_drafts: int = Field(default=0, ge=0, description="also wait until the serving eye has seen each "
                                    "restarted server make this many speculative steps with the new drafter (0: "
                                    "health and the drafter it names are the check)")
    verify_timeout_s: float = Field(default=300, gt=0, description="how long that may take per server")


def _seen_serving(instance, name: str, drafter: str, since: float, drafts: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        obs = [o for o in served.observations(instance, name, since=since) if o.get("drafter") == drafter]
        if sum(int(o.get("num_drafts") or 0) for o in obs) >= drafts:
            return True
        time.sleep(5)
    return False


@dg.asset(group_name="loop", partitions_def=engine_partitions, deps=["production_drafter"],
          code_version=code_version(__name__, "rollout"))
def rollout(context: dg.AssetExecutionContext, config: RolloutConfig) -> dg.MaterializeResult:
    """The production drafter on each server of the engine (partition) that has a restart command in the servers
    file (EAGLE3_SERVERS), one at a time; the first that fails is rolled back and stops the rollout."""
    engine = context.partition_key
    prod = production.current(context.instance, engine)
    if prod is None:
        raise dg.Failure(description=f"nothing is in production on {engine}: promote a drafter first")
    if not os.environ.get(SERVERS_ENV):
        raise dg.Failure(description=f"no servers to roll out to: list them in the file {SERVERS_ENV} names")
    try:
        servers = [s for s in load_servers(os.environ[SERVERS_ENV]).servers if s.engine == engine]
    except ValueError as e:  # the file's own message names the field; no traceback to read through
        raise dg.Failure(description=str(e), allow_retries=False) from None
    new, done = prod["export_path"], {}
    if any(SPEC_CONFIG in part for s in servers for part in s.restart or []):
        # the launch file is shared by whatever measured last (a sweep, a gate run again): it must be the schedule
        # the instance recorded for this drafter, which the eye and serving_benchmark hold the servers to
        sched, _ = schedule_for(context.instance, engine, prod["version"])
        if sched is not None and (bad := servers_rollout.launch_differs(new, engine, sched["schedule"])):
            raise dg.Failure(description=f"rollout of {prod['version'][:12]} not started, no server touched: {bad}. "
                                         "Materialize its schedule again (challenger_schedule, or "
                                         "speculation_schedule), then roll out", allow_retries=False)
    for s in servers:
        old = served.rolled_out(context.instance, s.name) or served.serving_now(
            served.observations(context.instance, s.name, limit=50)) or s.drafter
        if old and old.rstrip("/") == new.rstrip("/"):
            done[s.name] = {"drafter": new, "status": "already serving it"}
            continue
        if not s.restart:
            done[s.name] = {"drafter": old, "status": "left as it is: no restart command in the servers file"}
            context.log.warning(f"{s.name}: no restart command in the servers file: still on {old}")
            continue
        t0 = time.time()
        why = servers_rollout.restart(s, new, context.log.info)
        if why is None and config.verify_live_drafts and not _seen_serving(
                context.instance, s.name, new, t0, config.verify_live_drafts, config.verify_timeout_s):
            why = (f"the serving eye saw it make fewer than {config.verify_live_drafts} speculative steps with the new "
                   f"drafter within {config.verify_timeout_s:.0f} s")
        if why is None:
            done[s.name] = {"drafter": new, "status": "rolled out", "took_s": round(time.time() - t0, 1)}
            context.log.info(f"{s.name}: serving {new} ({time.time() - t0:.0f} s)")
            continue
        back = servers_rollout.restart(s, old, context.log.info) if old else "no drafter to go back to"
        done[s.name] = {"drafter": old if back is None else None, "status": f"failed: {why}; "
                        + ("rolled back" if back is None else f"rolling back failed too: {back}")}
        context.instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=ROLLOUT, partition=engine, metadata={"version": prod["version"], "servers": done,
                                                           "stopped_at": s.name}))
        raise dg.Failure(description=f"rollout of {prod['version'][:12]} stopped at {s.name}: {why}; "
                                     + ("it is back on its previous drafter" if back is None else
                                        f"and putting it back failed: {back}") + ". The servers after it were not touched",
                         metadata={"servers": dg.MetadataValue.json(done)}, allow_retries=False)
    return dg.MaterializeResult(metadata={"version": prod["version"], "export_path": new,
                                          "servers": dg.MetadataValue.json(done),
                                          "rolled_out": sum(d["status"] == "rolled out" for d in done.values())})
