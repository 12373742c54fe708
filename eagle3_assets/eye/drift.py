"""Drift: when a served drafter stops fitting its traffic, measured two ways, each turned into a `drift_report` run.

- Live (`live_drift_sensor`, on by default with a servers file; it only reads Dagster's own records, so it costs
  nothing): per server, the acceptance over every speculative step of its last `drift.window_s` seconds of
  observations (live_acceptance.py), against the benchmarked figure of the drafter it serves (served.py). Below it by
  more than `drift.live_drop`: the check `live_acceptance_holds` on `live_acceptance/<server>` fails and a report
  run starts, which (with `drift.locate`) replays the newest traffic to say where.
- Offline (`traffic_drift_sensor`, off by default: each check replays traffic on the host): each newly
  materialized `traffic` day is replayed by the drafter served (traffic_acceptance); a replay whose acceptance falls
  below the drafter's eval figure by more than `drift.offline_drop` starts a report run.

An acceptance length near 1 (drift.collapse_below) is a collapse, not drift: an error, reported at once without a
replay (collapse.py), and never retrained on. A window that cannot be judged fails the check as a warning, and as an
error once it lasts drift.unjudged_after_s.

A drift is reported when it starts, when the server's drafter changes while it lasts, and again every
`drift.report_every_s`: a sensor's cursor keeps each server's state, so a lasting drift is not a report a minute."""

import json
import os
import time

import dagster as dg
import fsspec

from ..assets.executor import ONE_PROCESS
from ..sources.gateway_logs import TrafficError, expand, served_figures
from . import served
from .servers_file import SERVERS_ENV, DriftSettings, Server, ServersFile, asset_key, load_servers
from .traffic import LOGS_ENV, traffic_partitions

LIVE_CHECK = "live_acceptance_holds"
RUN_KEY_TAG = "dagster/run_key"  # the run key a sensor's run carries (Dagster's own tag)
DRIFT_TAG = "eagle3/drift"  # on every run a drift sensor starts: what it is about (a server, or a traffic day)
# on a live signal's report runs: the server it is about. The queue runs one at a time per server (dagster.yaml's
# tag_concurrency_limits) and the sensor requests none while one is queued or running
REPORT_ON_TAG = "eagle3/report_on"
REPLAY, REPORT, TRAFFIC = dg.AssetKey("traffic_acceptance"), dg.AssetKey("drift_report"), dg.AssetKey("traffic")
ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
          dg.DagsterRunStatus.STARTED]
STALE_WINDOWS = 2  # a live report run starting this many windows after the sensor saw its window is checked again

drift_report_job = dg.define_asset_job(
    "report_drift", selection=[TRAFFIC, REPLAY, REPORT], partitions_def=traffic_partitions, executor_def=ONE_PROCESS,
    description="made by a drift sensor: (today's traffic, its replay by the served drafter, then) the drift report")
check_traffic_job = dg.define_asset_job(
    "check_traffic", selection=[REPLAY], partitions_def=traffic_partitions, executor_def=ONE_PROCESS,
    description="the offline drift signal: a day of traffic replayed by the served drafter (traffic_drift_sensor)")


def comparable(win: dict, info: dict) -> tuple[float, float, str] | None:
    """(live, benchmark, how) acceptance lengths that compare: whole when served at the benchmark's k; over the draft
    positions both measured when the k differ (a chain draft's position i is accepted or not whatever follows it, so
    its acceptance does not depend on k); None when the k differ and either side has no per-position figures."""
    live, bench = win["acceptance_length"], info["benchmark_acceptance_length"]
    kw, kb = win.get("k"), info.get("benchmark_k")
    if not kw or not kb or kw == kb:
        return live, bench, ""
    pos_w, pos_b = win.get("acceptance_per_pos") or [], info.get("benchmark_acceptance_per_pos") or []
    m = min(kw, kb, len(pos_w), len(pos_b))
    if not m:
        return None
    return (1 + sum(pos_w[:m]), 1 + sum(pos_b[:m]),
            f" over the first {m} draft position{'s' if m > 1 else ''} (served with k={kw}, benchmarked with k={kb})")


def collapse_suspected(win: dict, info: dict, settings: DriftSettings) -> str | None:
    """Why the window looks like a collapse, or None: its first draft position accepted at most drift.collapse_ratio
    as often as on the drafter's benchmark (the first position's acceptance is the same at every k, where an
    acceptance length of 1.1 is a 10 % rate at k = 1 and a broken drafter at k = 3); with no benchmark per position,
    at most drift.collapse_below - 1 (1.1: 10 %)."""
    pos = win.get("acceptance_per_pos") or []
    first = pos[0] if pos else win["acceptance_length"] - 1 if win.get("k") == 1 else None
    ref = (info.get("benchmark_acceptance_per_pos") or [None])[0]
    steps = f"{win['num_drafts']} speculative steps in the last {settings.window_s} s"
    if first is not None and ref:
        low = first <= settings.collapse_ratio * ref
        why = (f"its first draft position accepted on {first:.1%} of {steps} against {ref:.1%} on its benchmark "
               f"({first / ref:.0%} of it; drift.collapse_ratio {settings.collapse_ratio:.0%})")
    elif first is not None:
        low = first <= settings.collapse_below - 1
        why = (f"its first draft position accepted on {first:.1%} of {steps} (no benchmark per position; "
               f"drift.collapse_below {settings.collapse_below:g}: {settings.collapse_below - 1:.0%})")
    else:
        low = win["acceptance_length"] <= settings.collapse_below
        why = f"acceptance length {win['acceptance_length']:.3f} over {steps} (drift.collapse_below " \
              f"{settings.collapse_below:g})"
    return why if low else None


def judge(drafter: str | None, win: dict, info: dict, settings: DriftSettings) -> dict:
    """A server's live window against its drafter's benchmark: {"state": collapse | drift | fits | unknown, "why",
    "drop"}. "collapse" is a suspicion: the drift report tells a collapse from a drift to traffic the drafter never
    saw (drift_report.py)."""
    live = win["acceptance_length"]
    if drafter is not None and win["num_drafts"] >= settings.min_drafts and live is not None and \
            (why := collapse_suspected(win, info, settings)):  # judged with or without a reference figure
        return {"state": "collapse", "drop": None,
                "why": f"{why}: the drafter's tokens are almost never accepted. A collapse of the server's integration "
                       "(its speculative method, aux layers, draft vocabulary, attention backend), which retraining "
                       "cannot fix, or traffic the drafter has never seen (a new language), which retraining is for: "
                       "the drift report tells them apart (the benchmark's own prompts sent to the server, the "
                       "config it runs)"}
    if drafter is None:
        return {"state": "unknown", "drop": None, "why": "no read of the server names the drafter it serves yet: "
                "wait for live_acceptance_sensor, or set drafter in the servers file"}
    if info["benchmark_acceptance_length"] is None:
        return {"state": "unknown", "drop": None, "why": "no benchmark of the drafter served: materialize "
                "serving_benchmark for it, or give benchmark_acceptance_length in the servers file"}
    if win["num_drafts"] < settings.min_drafts:
        return {"state": "unknown", "drop": None, "why": f"{win['num_drafts']} speculative steps in the last "
                f"{settings.window_s} s, fewer than drift.min_drafts {settings.min_drafts}: not judged"}
    figures = comparable(win, info)
    if figures is None:
        return {"state": "unknown", "drop": None, "why": f"served with {win['k']} speculative tokens, benchmarked "
                f"with {info['benchmark_k']}, and no figures per draft position to compare on the positions both "
                "drafted: start the server with the schedule measured for its drafter ({speculative_config} in the "
                "servers file's restart command, or vLLM's --speculative-config with the speculative_config.vllm.json "
                f"written beside the export), or benchmark it at k={win['k']} (serving_benchmark with schedule: off "
                f"and num_speculative_tokens: {win['k']})"}
    live, bench, how = figures
    drop = (bench - live) / bench
    state = "drift" if drop > settings.live_drop else "fits"
    return {"state": state, "drop": round(drop, 4), "compared": [round(live, 4), round(bench, 4), how],
            "why": f"acceptance length {live:.3f} over {win['num_drafts']} speculative steps in the last "
                   f"{settings.window_s} s{how}, {abs(drop):.1%} {'below' if drop > 0 else 'above'} the drafter's "
                   f"benchmarked {bench:.3f} (drift below {settings.live_drop:.0%})"}


def live_state(instance: dg.DagsterInstance, server: Server, settings: DriftSettings, now: float) -> dict:
    """Everything the live signal knows of one server now: the drafter served, its window and verdict."""
    obs = served.observations(instance, server.name, since=now - settings.window_s)
    drafter = served.serving_now(obs) or served.serving_now(served.observations(instance, server.name, limit=50))
    win = served.window(obs, drafter, now - settings.window_s)
    info = served.describe(instance, server, drafter)
    return {"drafter": drafter, "window": win, "info": info, **judge(drafter, win, info, settings)}


def check_evaluation(server: Server, state: dict, unjudged_s: float = 0, settings: DriftSettings | None = None
                     ) -> dg.AssetCheckEvaluation:
    """Passed only when judged and within the drop. A window that cannot be judged is a WARN-severity failure, not a
    pass (the UI paints it as a warning, not green: "not judged" is not "fits"), saying why; one unjudged for longer
    than drift.unjudged_after_s is an ERROR, the server itself reported."""
    win, info = state["window"], state["info"]
    limit = settings.unjudged_after_s if settings else 0
    long_blind = state["state"] == "unknown" and limit and unjudged_s >= limit
    why = state["why"]
    if state["state"] == "unknown":
        why = (f"not judged for {unjudged_s / 60:.0f} min (drift.unjudged_after_s {limit} s): " if long_blind
               else "not judged: ") + why
    return dg.AssetCheckEvaluation(
        asset_key=asset_key(server.name), check_name=LIVE_CHECK, passed=state["state"] == "fits",
        severity=dg.AssetCheckSeverity.ERROR if long_blind or state["state"] == "collapse"
        else dg.AssetCheckSeverity.WARN, description=why,
        metadata={"state": state["state"], "num_drafts": win["num_drafts"], "drafter": state["drafter"] or "unknown",
                  "checkpoint": info["checkpoint"] or "not exported by this instance",
                  "reference": info["benchmark_from"] or "none",
                  **({"unjudged_s": round(unjudged_s)} if state["state"] == "unknown" else {}),
                  # numbers only where measured: the UI plots each one over the check's history
                  **{k: v for k, v in (("live_acceptance_length", win["acceptance_length"]),
                                       ("benchmark_acceptance_length", info["benchmark_acceptance_length"]))
                     if v is not None}})


def newest_traffic_day(instance: dg.DagsterInstance) -> str | None:
    """Today when the gateway logs are configured (a report run reads today so far), else the newest day
    materialized."""
    if os.environ.get(LOGS_ENV):
        return traffic_partitions.get_last_partition_key()
    done = instance.get_materialized_partitions(TRAFFIC)
    return max(done) if done else None


def logs_carry_served_figures(tail_bytes: int = 65536) -> bool:
    """Whether the newest gateway log (EAGLE3_TRAFFIC_LOGS) logs responses with vLLM's per-request figures: read from
    the end of its newest file only, a few records."""
    sources = [s for s in os.environ.get(LOGS_ENV, "").split(",") if s.strip()]
    try:
        files = expand([s.strip() for s in sources])
        with fsspec.open(files[-1], "rb", compression="infer") as f:
            if not files[-1].endswith(".gz"):
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail_bytes))
            lines = f.read(tail_bytes * 4 if files[-1].endswith(".gz") else tail_bytes).splitlines()[1:]
    except (TrafficError, OSError, IndexError, ValueError):
        return False
    for raw in reversed(lines[-50:]):
        try:
            if served_figures(json.loads(raw), "a gateway log record") is not None:
                return True
        except (ValueError, TrafficError):
            continue
    return False


def locate_from(instance: dg.DagsterInstance, settings: DriftSettings) -> str:
    """served, replay or both (drift.locate_from); auto is served when production's own per-request figures are at
    hand (the newest traffic day held them, or the gateway's newest log carries them: the day the report reads will
    too), else replay. The served figures cost nothing; a replay costs the host minutes, beside production where
    they share a machine."""
    if settings.locate_from != "auto":
        return settings.locate_from
    recs = instance.fetch_materializations(TRAFFIC, limit=1).records
    if recs and served.meta(recs[0]).get("requests_served"):
        return "served"
    return "served" if os.environ.get(LOGS_ENV) and logs_carry_served_figures() else "replay"


def report_request(instance: dg.DagsterInstance, server: Server, state: dict, settings: DriftSettings,
                   now: float) -> dg.RunRequest:
    """A live drift's report run: with `locate`, today's traffic read first, and replayed by the served drafter unless
    the acceptance production served per request locates it (locate_from)."""
    collapse = state["state"] == "collapse"  # suspected: the traffic's kinds as served help tell, nothing to replay
    day = newest_traffic_day(instance) if settings.locate or (collapse and os.environ.get(LOGS_ENV)) else None
    win, info = state["window"], state["info"]
    live, bench, how = state.get("compared") or (win["acceptance_length"], info["benchmark_acceptance_length"], "")
    config = {"signal": "collapse" if collapse else "live", "server": server.name, "drafter": state["drafter"],
              "live_acceptance_length": live, "num_drafts": win["num_drafts"], "window_s": settings.window_s,
              "benchmark_acceptance_length": bench, "benchmark_from": info["benchmark_from"] + how
              if info["benchmark_from"] else None, "traffic_day": day, "observed_at": now,
              "why": state.get("why")}
    ops = {"drift_report": {"config": config}}
    selection = [REPORT]
    if day is not None:
        where = "served" if collapse else locate_from(instance, settings)
        selection = ([TRAFFIC] if os.environ.get(LOGS_ENV) else []) + \
            ([REPLAY] if where in ("replay", "both") else []) + [REPORT]
        if REPLAY in selection:
            ops["traffic_acceptance"] = {"config": {"drafter": state["drafter"], "server": server.name,
                                                    "limit": settings.replay_limit}}
    # the report alone is unpartitioned: a partition key would ask Dagster for a partitioned selection
    return dg.RunRequest(run_key=f"live-{server.name}-{int(now)}", asset_selection=selection,
                         partition_key=day if selection != [REPORT] else None, run_config={"ops": ops},
                         tags={DRIFT_TAG: f"{'collapse' if collapse else 'live'}:{server.name}",
                               REPORT_ON_TAG: server.name})


def reporting(instance: dg.DagsterInstance, server: str) -> bool:
    """Whether a live report run on the server is queued or running: two at once would replay and probe side by side
    on the host and the server they report on."""
    return bool(instance.get_runs(dg.RunsFilter(tags={REPORT_ON_TAG: server}, statuses=ACTIVE), limit=1))


def stale(instance: dg.DagsterInstance, tags: dict, server: str | None, observed_at: float | None,
          drafter: str | None = None) -> str | None:
    """Why a live report run should not go on, or None: its window passed STALE_WINDOWS windows ago (it waited in
    the queue, a daemon restarted) and the server has moved on since (judged otherwise now, or serving another
    drafter). A window too thin to judge now has not moved on: the report goes on."""
    kind, _, _ = str(tags.get(DRIFT_TAG, "")).partition(":")
    path = os.environ.get(SERVERS_ENV)
    if kind not in ("live", "collapse") or not server or observed_at is None or not path:
        return None
    try:
        parsed = load_servers(path)
    except ValueError:
        return None
    entry = next((s for s in parsed.servers if s.name == server), None)
    age, now = time.time() - observed_at, time.time()
    if entry is None or age <= STALE_WINDOWS * parsed.drift.window_s:
        return None
    state = live_state(instance, entry, parsed.drift, now)
    if drafter and state["drafter"] and state["drafter"] != drafter:
        now_is = f"it serves {state['drafter']} now, not {drafter}"
    elif state["state"] not in ("drift" if kind == "live" else "collapse", "unknown"):
        now_is = f"{state['state']} now ({state['why']})"
    else:
        return None
    return (f"the window it reports on ended {age / 60:.0f} min ago (drift.window_s {parsed.drift.window_s} s) and "
            f"{server} has moved on since: {now_is}")


def unmade(instance: dg.DagsterInstance, before: dict, now: float, settings: DriftSettings) -> bool:
    """Whether the report run requested last ended without its report (canceled, failed: a daemon stopped mid-run): a
    drift that lasts is not reported twice, but one whose report was never made is reported again, once a window at
    most (a report that keeps failing is not retried every tick)."""
    key = before.get("report_key")
    if not key or now - before.get("reported", 0) < settings.window_s:
        return False
    runs = instance.get_runs(dg.RunsFilter(tags={RUN_KEY_TAG: key}), limit=1)
    return bool(runs) and runs[0].status in (dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.FAILURE)


def build(parsed: ServersFile | None) -> tuple[list[dg.SensorDefinition], list[dg.AssetChecksDefinition]]:
    """The live drift sensor and its check on each server's live acceptance (none without a servers file), and the
    traffic drift sensor (always: it needs only traffic and a drafter)."""
    sensors: list[dg.SensorDefinition] = [traffic_drift_sensor(parsed)]
    if parsed is None:
        return sensors, []
    settings = parsed.drift
    specs = [dg.AssetCheckSpec(LIVE_CHECK, asset=asset_key(s.name), description="the server's acceptance over the "
                               "last drift.window_s within drift.live_drop of its drafter's benchmark")
             for s in parsed.servers]

    @dg.multi_asset_check(specs=specs, name="live_acceptance_holds", can_subset=True)
    def live_acceptance_holds(context: dg.AssetCheckExecutionContext):
        """Run from the UI, the live drift sensor's judgement now (the sensor records it as it changes)."""
        for s in parsed.servers:
            if dg.AssetCheckKey(asset_key(s.name), LIVE_CHECK) in context.selected_asset_check_keys:
                e = check_evaluation(s, live_state(context.instance, s, settings, time.time()))  # the blind
                # spell's length is the sensor's to keep (its cursor): judged here on the window alone
                yield dg.AssetCheckResult(asset_key=e.asset_key, check_name=LIVE_CHECK, passed=e.passed,
                                          severity=e.severity, description=e.description, metadata=e.metadata)

    @dg.sensor(name="live_drift_sensor", minimum_interval_seconds=parsed.interval_s,
               default_status=dg.DefaultSensorStatus.RUNNING, job=drift_report_job,
               description="the live drift signal: each server's acceptance over drift.window_s against its "
                           "drafter's benchmark; a drop beyond drift.live_drop starts a drift_report run")
    def live_drift_sensor(context: dg.SensorEvaluationContext):
        cursor, now = json.loads(context.cursor) if context.cursor else {}, time.time()
        events, requests = [], []
        for s in parsed.servers:
            state, before = live_state(context.instance, s, settings, now), cursor.get(s.name, {})
            if state["state"] != "unknown":
                before.pop("unjudged_since", None)
            else:
                before.setdefault("unjudged_since", now)
            unjudged = now - before.get("unjudged_since", now)
            long_blind = bool(settings.unjudged_after_s and unjudged >= settings.unjudged_after_s)
            if state["state"] != before.get("state") or state["drafter"] != before.get("drafter") or \
                    long_blind != before.get("long_blind", False) or \
                    now - before.get("checked", 0) >= settings.window_s:  # a verdict as it changes, else per window
                events.append(check_evaluation(s, state, unjudged, settings))
                before["checked"] = now
                if long_blind and not before.get("long_blind"):
                    context.log.warning(f"{s.name}: its live acceptance has not been judged for {unjudged / 60:.0f} "
                                        f"min: {state['why']}")
            before["long_blind"] = long_blind
            # the last verdict judged: a window too thin to judge (traffic paused) neither ends a drift nor starts one;
            # but a verdict on the drafter before is none on this one (a rollout's first windows are thin): carried
            # over, the new drafter's own drift would read as the old one lasting, and never be reported
            switched = bool(state["drafter"]) and state["drafter"] != before.get("drafter")
            judged = state["state"] if state["state"] != "unknown" else None if switched else before.get("judged")
            again = settings.report_every_s and now - before.get("reported", 0) >= settings.report_every_s
            if state["state"] in ("drift", "collapse") and (before.get("judged") != state["state"] or
                                                            state["drafter"] != before.get("drafter") or again or
                                                            unmade(context.instance, before, now, settings)):
                if reporting(context.instance, s.name):  # one report of a server at a time; this verdict is
                    # reported once that one has ended (the verdict judged before is kept: the change is seen again)
                    context.log.info(f"{s.name}: {state['state']}, but a report on it is queued or running: "
                                     "reported once it ends")
                    judged, state = before.get("judged"), {**state, "drafter": before.get("drafter")}
                else:
                    req = report_request(context.instance, s, state, settings, now)
                    requests.append(req)
                    before["reported"], before["report_key"] = now, req.run_key
            cursor[s.name] = {**before, "state": state["state"], "judged": judged,
                              "drafter": state["drafter"] or before.get("drafter")}
        return dg.SensorResult(run_requests=requests, asset_events=events, cursor=json.dumps(cursor))

    return [*sensors, live_drift_sensor], [live_acceptance_holds]


def served_drafters(instance: dg.DagsterInstance, parsed: ServersFile | None) -> dict[str, str | None]:
    """drafter path -> a server serving it, for every watched server's drafter now; else the newest export's."""
    out: dict[str, str | None] = {}
    for s in parsed.servers if parsed else []:
        d = served.serving_now(served.observations(instance, s.name, limit=50))
        if d:
            out.setdefault(d, s.name)
    if not out:
        rec = next(iter(instance.fetch_materializations(served.EXPORT, limit=1).records), None)
        path = next((v for k, v in served.meta(rec).items() if k.endswith("_path")), None) if rec else None
        if path:
            out[str(path)] = None
    return out


def traffic_drift_sensor(parsed: ServersFile | None) -> dg.SensorDefinition:
    settings = parsed.drift if parsed else DriftSettings()

    @dg.sensor(name="traffic_drift_sensor", minimum_interval_seconds=settings.offline_interval_s,
               jobs=[check_traffic_job, drift_report_job],
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="the offline drift signal (off by default: each check replays traffic on the host): each "
                           "new traffic day replayed by the served drafter; a replay below its eval figure by more "
                           "than drift.offline_drop starts a drift_report run")
    def sensor(context: dg.SensorEvaluationContext):
        cursor = json.loads(context.cursor) if context.cursor else {}
        requests = []
        days = dg.AssetRecordsFilter(asset_key=TRAFFIC, after_storage_id=cursor.get("traffic"))
        new = context.instance.fetch_materializations(days, limit=100).records
        if new:
            cursor["traffic"] = max(r.storage_id for r in new)
            day = max(r.event_log_entry.asset_materialization.partition for r in new)
            newest = max((r for r in new if r.event_log_entry.asset_materialization.partition == day),
                         key=lambda r: r.storage_id)
            for drafter, server in served_drafters(context.instance, parsed).items():
                requests.append(dg.RunRequest(
                    run_key=f"replay-{day}-{newest.storage_id}-{drafter}", job_name="check_traffic", partition_key=day,
                    run_config={"ops": {"traffic_acceptance": {"config": {
                        "drafter": drafter, "server": server, "limit": settings.replay_limit}}}},
                    tags={DRIFT_TAG: f"offline:{day}"}))
        replays = dg.AssetRecordsFilter(asset_key=REPLAY, after_storage_id=cursor.get("replays"))
        for rec in context.instance.fetch_materializations(replays, limit=100, ascending=True).records:
            cursor["replays"] = rec.storage_id
            m, run = served.meta(rec), context.instance.get_run_by_id(rec.run_id)
            if not m.get("drift") or (run is not None and str(run.tags.get(DRIFT_TAG, "")).startswith("live:")):
                continue  # it fits, or a live drift's report run made it and reported it
            day = rec.event_log_entry.asset_materialization.partition
            requests.append(dg.RunRequest(
                run_key=f"offline-{rec.storage_id}", job_name="report_drift", asset_selection=[REPORT],
                tags={DRIFT_TAG: f"offline:{day}"}, run_config={"ops": {"drift_report": {"config": {
                    "signal": "offline", "server": m.get("server") or None, "drafter": m.get("drafter"),
                    "traffic_day": day, "traffic_acceptance_storage_id": rec.storage_id}}}}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(cursor))

    return sensor
