"""The serving eye's first signal: acceptance as the production servers see it, from their own counters.

The servers are listed in a YAML file (`EAGLE3_SERVERS`), each with its engine and, where the server does not
tell, the drafter it serves. A sensor scrapes each one at an interval and records what happened since its last
read as an observation of that server's asset `live_acceptance/<name>` (Dagster plots the numbers over time):
vLLM's `/metrics` counters differenced into acceptance length and per-position acceptance; SGLang's
`/get_server_info`, whose `avg_spec_accept_length` is an average since the server started (SGLang exposes no
counters to difference). A sensor rather than an observable source asset: the difference needs the previous
read, which the sensor's cursor keeps between ticks, and a tick launches no run (it costs one HTTP request per
server). A server that does not answer, or answers what cannot be counted (NaN, Inf), is an observation saying so;
counters that went back (a restart) start a new window from the restart. The servers are read at once, each within
its own timeout and all within TICK_CAP_S, so that one slow or broken server neither fails the tick nor starves the
others (Dagster cuts a sensor's tick at 60 s).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import dagster as dg

from ..assets.speculation_schedule import schedule_for
from ..common import spec_counters
from . import served
from .servers_file import DEFAULT_INTERVAL_S, Server, ServersFile, asset_key

TICK_CAP_S = 30.0  # every server's read within this (Dagster's 60 s per tick, less the records written after)


# ---- one read of one server -----------------------------------------------------------------------------
MAX_BODY = 16 << 20  # a /metrics page is kilobytes; more is not a server to trust with memory


def http_get(url: str, timeout_s: float) -> bytes:
    """The body within `timeout_s` in all: a socket's timeout bounds each read, not a body trickled a byte at a
    time, whose reader would outlive the tick (and pile up, one a tick)."""
    deadline = time.monotonic() + timeout_s
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (the user's own server URL)
        body = bytearray()
        while chunk := r.read1(65536):
            body += chunk
            if time.monotonic() > deadline:
                raise TimeoutError(f"its answer was still coming after {timeout_s:g} s ({len(body)} bytes)")
            if len(body) > MAX_BODY:
                raise ValueError(f"its answer is over {MAX_BODY >> 20} MB")
        return bytes(body)


def server_info(server: Server) -> dict | None:
    """vLLM's /server_info (a dev-mode route: VLLM_SERVER_DEV_MODE=1), or None where the server does not give it."""
    try:
        info = json.loads(http_get(f"{server.url}/server_info?config_format=json", server.timeout_s))
    except (OSError, ValueError):  # not in dev mode (404), or not JSON
        return None
    return info if isinstance(info, dict) else None


def _vllm_drafter(server: Server) -> tuple[str | None, str]:
    """The drafter a vLLM server serves: its own word where it gives it (/server_info), else the servers file's."""
    spec = ((server_info(server) or {}).get("vllm_config") or {}).get("speculative_config") or {}
    if isinstance(spec, dict) and spec.get("model"):
        return str(spec["model"]), "server"
    return server.drafter, "config"


def _not_counted(counters: dict) -> str | None:
    """Why counters cannot be differenced (a NaN or an infinity in one, a negative count), or None."""
    named = {f"{spec_counters.VLLM_PREFIX}{c}": counters[c] for c in spec_counters.COUNTERS}
    named.update({f"{spec_counters.VLLM_PREFIX}num_accepted_tokens_per_pos[{i}]": v
                  for i, v in enumerate(counters["per_pos"])})
    for name, v in named.items():
        if not math.isfinite(v) or v < 0:
            shown = "NaN" if math.isnan(v) else "+Inf" if v == math.inf else "-Inf" if v == -math.inf else f"{v:g}"
            return f"its /metrics shows {shown} in {name}: not a count; its metrics are broken (restart it)"
    return None


def read(server: Server, timeout_s: float | None = None) -> dict:
    """What the server's counters say now: {"ok": True, "counters" | "since_start", "drafter", ...} or
    {"ok": False, "error"}."""
    server = server.model_copy(update={"timeout_s": min(server.timeout_s, timeout_s or server.timeout_s)})
    try:
        if server.engine == "vllm":
            text = http_get(f"{server.url}/metrics", server.timeout_s).decode()
            counters = spec_counters.vllm_counters(text)
            if not counters["present"]:
                return {"ok": False, "error": "its /metrics has no vllm:spec_decode_* counters: it serves without "
                                              "speculative decoding, or is not vLLM"}
            if why := _not_counted(counters):
                return {"ok": False, "error": why, "status": "bad counters"}
            drafter, told = _vllm_drafter(server)
            counters["load"] = spec_counters.vllm_load(text)
            return {"ok": True, "counters": counters, "drafter": drafter, "drafter_from": told}
        info = json.loads(http_get(f"{server.url}/get_server_info", server.timeout_s))
        states = info.get("internal_states") or [{}]
        return {"ok": True, "since_start": states[0].get("avg_spec_accept_length"),
                "drafter": info.get("speculative_draft_model_path") or server.drafter,
                "drafter_from": "server" if info.get("speculative_draft_model_path") else "config"}
    except (OSError, ValueError) as e:  # refused, timed out, HTTP error, not JSON
        reason = e.reason if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError) else e
        return {"ok": False, "error": f"{type(e).__name__}: {reason}"}


def observe(server: Server, now: dict, before: dict | None, t: float) -> tuple[dg.AssetObservation, dict | None]:
    """The observation of one interval, and what to keep for the next (None: keep the last good read)."""
    base = {"engine": server.engine, "url": server.url}
    if not now["ok"]:
        meta = {**base, "status": f"{now.get('status', 'unreachable')}: {now['error']}"}
        return dg.AssetObservation(asset_key=asset_key(server.name), metadata=meta), None
    base.update({"drafter": now.get("drafter") or "unknown (set drafter in the servers file)",
                 "drafter_from": now["drafter_from"]})
    if server.engine == "sglang":
        al = now["since_start"]
        meta = {**base, "status": "ok" if al is not None else "idle",
                "window": "since the server started (SGLang reports an average, no counters)"}
        if al is not None:
            meta["acceptance_length"] = float(al)
        return dg.AssetObservation(asset_key=asset_key(server.name), metadata=meta), {"t": t}
    prev = before.get("counters") if before else None
    w = spec_counters.window(prev, now["counters"])
    if prev is None:
        status = "first read: figures since the server started"
    elif w["restarted"]:
        status = "restarted: its counters went back; a new window from the restart"
    else:
        status = "ok" if w["num_drafts"] else "idle: no speculative step since the last read"
    meta = {**base, "status": status, "num_drafts": w["num_drafts"]}
    load = now["counters"].get("load") or {}
    meta.update({k: load[k] for k in ("requests_running", "requests_waiting") if k in load})  # gauges, at the read
    if before and not w["restarted"]:
        meta["window_s"] = round(t - before["t"], 1)
        meta.update(spec_counters.load_between((prev or {}).get("load") or {}, load, t - before["t"]))
    if w["num_drafts"]:
        meta.update({"acceptance_length": round(w["acceptance_length"], 4),
                     "acceptance_rate": round(w["acceptance_rate"], 4),
                     "num_draft_tokens": w["num_draft_tokens"], "num_accepted_tokens": w["num_accepted_tokens"],
                     "acceptance_per_pos": json.dumps([round(x, 4) for x in w["acceptance_per_pos"]])})
    return dg.AssetObservation(asset_key=asset_key(server.name), metadata=meta), {"t": t, "counters": now["counters"]}


def tied(instance: dg.DagsterInstance, server: Server, event: dg.AssetObservation) -> dg.AssetObservation:
    """The observation with what lineage says of the drafter served: the checkpoint it was exported from and its
    benchmarked acceptance length (plotted beside the live one)."""
    drafter = event.metadata.get("drafter")
    if drafter is None:
        return event
    drafter, extra = getattr(drafter, "value", drafter), {}
    told = getattr(event.metadata.get("drafter_from"), "value", None)
    if told == "config" and (rolled := served.rolled_out(instance, server.name)):  # the file predates a rollout
        drafter, extra = rolled, {"drafter": rolled, "drafter_from": "rollout"}
    info = served.describe(instance, server, drafter)
    extra["checkpoint"] = info["checkpoint"] or "not exported by this instance"
    if info["benchmark_acceptance_length"] is not None:
        extra["benchmark_acceptance_length"] = info["benchmark_acceptance_length"]
    extra.update(beyond_schedule(instance, server, info["checkpoint"], event.metadata))
    return dg.AssetObservation(asset_key=event.asset_key, metadata={**event.metadata, **extra})


def beyond_schedule(instance: dg.DagsterInstance, server: Server, checkpoint: str | None, meta) -> dict:
    """Where a server ran batches larger than any concurrency its drafter's speculation schedule was measured at:
    the schedule's k there is a guess (its last range stretched to the engine's limit), said on the observation.
    Judged on the window's mean batch, else the running gauge; nothing without a schedule for the checkpoint."""
    def num(key):
        v = meta.get(key)
        return getattr(v, "value", v)

    batch = num("mean_requests_running")
    batch = num("requests_running") if batch is None else batch
    if not checkpoint or batch is None:
        return {}
    sched, _ = schedule_for(instance, server.engine, checkpoint)
    if not sched or not sched.get("grid"):
        return {}
    top = max(int(c) for c in sched["grid"])
    out = {"schedule_measured_up_to": top}
    if batch > top:
        out["load_beyond_schedule"] = (f"{batch:g} requests running at once, beyond the largest concurrency its "
                                       f"speculation schedule measured ({top}): re-measure speculation_schedule with a "
                                       f"grid up to the load served")
    return out


def tick(servers: list[Server], cursor: str | None,
         instance: dg.DagsterInstance | None = None) -> tuple[list[dg.AssetObservation], str]:
    """One round over every server: the observations and the next cursor (each server's last good read)."""
    kept = json.loads(cursor) if cursor else {}
    t, cap = time.time(), TICK_CAP_S
    pool = ThreadPoolExecutor(max_workers=min(len(servers), 16) or 1, thread_name_prefix="live_acceptance")
    reads = {s.name: pool.submit(read, s, cap) for s in servers}
    wait_for(reads.values(), timeout=cap)
    pool.shutdown(wait=False, cancel_futures=True)  # a read past the cap ends by its own timeout (<= cap)
    events = []
    for s in servers:
        f = reads[s.name]
        if not f.done() or f.cancelled():
            now = {"ok": False, "error": f"it did not answer within the tick's {cap:g} s (read with the others)"}
        elif f.exception() is not None:
            now = {"ok": False, "status": "bad read", "error": f"{type(f.exception()).__name__}: {f.exception()}"}
        else:
            now = f.result()
        try:  # whatever one server answers, the others' observations are still recorded
            event, keep = observe(s, now, kept.get(s.name), t)
            event = tied(instance, s, event) if instance is not None else event
        except Exception as e:  # noqa: BLE001 (one server's figures, not the tick)
            event, keep = observe(s, {"ok": False, "status": "bad read",
                                      "error": f"{type(e).__name__}: {e}"}, None, t)
        events.append(event)
        if keep is not None:
            kept[s.name] = keep
    return events, json.dumps(kept)


# ---- the Dagster side -----------------------------------------------------------------------------------
def build(parsed: ServersFile | None, refused: str | None = None) -> tuple[list[dg.AssetSpec], list[dg.SensorDefinition]]:
    """The servers' assets and the sensor reading them, from the servers file; none without one. A file that was
    refused (`refused`: why): no server, and a sensor that says why on each tick, where the UI shows it."""
    if parsed is None and refused:
        why = f"NOT WATCHING: the servers file was refused when the code location loaded: {refused}. Fix it and " \
              "reload the code location"

        @dg.sensor(name="live_acceptance_sensor", minimum_interval_seconds=DEFAULT_INTERVAL_S, description=why,
                   default_status=dg.DefaultSensorStatus.RUNNING)
        def refused_sensor(context: dg.SensorEvaluationContext):
            return dg.SkipReason(why)

        return [], [refused_sensor]
    if parsed is None:
        return [], []
    specs = [dg.AssetSpec(asset_key(s.name), group_name="serving",
                          description=f"live acceptance of the {s.engine} server {s.name} ({s.url}), read from its "
                                      "own counters by live_acceptance_sensor; one observation per interval")
             for s in parsed.servers]

    @dg.sensor(name="live_acceptance_sensor", minimum_interval_seconds=parsed.interval_s,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="reads each production server's speculative-decoding counters (EAGLE3_SERVERS) and "
                           "records the acceptance since the last read as an observation")
    def live_acceptance_sensor(context: dg.SensorEvaluationContext):
        events, cursor = tick(parsed.servers, context.cursor, context.instance)  # as the code location loaded them
        return dg.SensorResult(asset_events=events, cursor=cursor)

    return specs, [live_acceptance_sensor]
