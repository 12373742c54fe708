"""drift_report: made by a drift sensor's run (drift.py), like benchmark_regression. Which signal fired (live: a
server's acceptance over a window below its drafter's benchmarked figure; offline: the drafter's replayed acceptance
on the newest traffic below its eval figure), by how much, and where: acceptance per group of the traffic (kind,
length, first words, the gateway fields a team named) as production served it, from the figures vLLM returned with
each request (the `traffic` day holds them when the gateway logs responses), and, where the day was replayed, our
replay's beside each group's share of the training prompts and the prompts of lowest acceptance (redacted). With it,
what lineage says of the served drafter: its benchmarks and its live figures over time."""

import time
from typing import Literal

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..common import charts
from ..hosts import GpuHost
from . import collapse, served
from .drift import stale
from .servers_file import drift_settings
from .traffic_acceptance import fmt, groups_table, lowest_table

REPLAY, TRAFFIC = dg.AssetKey("traffic_acceptance"), dg.AssetKey("traffic")


class DriftReportConfig(dg.Config):
    """Filled in by the sensor that fired (drift.py)."""

    signal: Literal["live", "offline", "collapse"] = Field(description="the signal that launched the report")
    server: str | None = Field(default=None, description="live: the server whose acceptance fell")
    drafter: str | None = Field(default=None, description="the drafter it serves (a path on the host)")
    live_acceptance_length: float | None = None
    benchmark_acceptance_length: float | None = None
    benchmark_from: str | None = None
    num_drafts: int | None = Field(default=None, description="live: speculative steps in the window")
    window_s: int | None = None
    observed_at: float | None = Field(default=None, description="live: when the sensor saw the window (unix s); the "
                                      "report's load compares that window, however long the run waited")
    traffic_day: str | None = Field(default=None, description="the traffic partition that locates the drift")
    traffic_acceptance_storage_id: int | None = Field(default=None, description="offline: the replay that fired")
    why: str | None = Field(default=None, description="live: the sensor's verdict on the window, in words")


def _replay(context, config: DriftReportConfig):
    """The traffic_acceptance replay this report stands on: the one named, else the newest of the day for the drafter
    (made by this run where it replayed the day)."""
    if config.traffic_acceptance_storage_id is not None:
        recs = context.instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=REPLAY, storage_ids=[config.traffic_acceptance_storage_id]), limit=1).records
        return recs[0] if recs else None
    if not config.traffic_day:
        return None
    for rec in context.instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=REPLAY, asset_partitions=[config.traffic_day]), limit=20).records:
        if config.drafter is None or served.meta(rec).get("drafter") == config.drafter:
            return rec
    return None


def where(groups: list[dict], reference: float | None, drop: float) -> list[dict]:
    """The groups whose acceptance is below the eval figure by more than `drop`, kinds first, lowest first."""
    if not reference:
        return []
    order = {"kind": 0, "length_bucket": 1, "first_words": 2}  # then the gateway's fields
    low = [g for g in groups if g["acceptance_length"] is not None and g["acceptance_length"] < reference * (1 - drop)]
    return sorted(low, key=lambda g: (order.get(g["by"], 3), g["acceptance_length"]))


def served_day(context, day: str | None) -> tuple[str | None, dict]:
    """The day's newest traffic partition (else the newest of any day) and its served figures, when its requests
    carried them."""
    flt = dg.AssetRecordsFilter(asset_key=TRAFFIC, asset_partitions=[day]) if day else TRAFFIC
    recs = context.instance.fetch_materializations(flt, limit=1).records
    m = served.meta(recs[0]) if recs else {}
    return (recs[0].event_log_entry.asset_materialization.partition, m) if m.get("requests_served") else (None, {})


def served_table(groups: list[dict], reference: float | None) -> str:
    """The served groups, lowest acceptance first, as a Markdown table."""
    lines = ["| by | group | requests | share | verify steps | acceptance length, served | vs reference |",
             "|---|---|---|---|---|---|---|"]
    for g in groups:
        vs = f"{(g['acceptance_length'] - reference) / reference:+.1%}" if reference else "-"
        lines.append(f"| {g['by']} | {g['value']} | {g['requests']} | {g['share']:.0%} | {g['steps']} | "
                     f"{fmt(g['acceptance_length'])} | {vs} |")
    return "\n".join(lines)


def where_served(day: str, m: dict, reference: float | None, source: str, drop: float) -> tuple[dict, str]:
    """The report's served lines: where the acceptance production served fell, below the reference by more than
    `drop` (the day's own figure when no reference is known)."""
    groups, overall = m.get("served_groups") or [], m["served_acceptance_length"]
    ref, source = (reference, source) if reference else (overall, "the day's own served figure")
    low = where(groups, ref, drop)
    meta = {"served_day": day, "requests_served": m["requests_served"], "served_acceptance_length": overall,
            "served_reference": ref}
    head = (f"**Where, as served**: {m['requests_served']} requests of {day}'s traffic sample carry the acceptance "
            f"vLLM served them ({m.get('served_steps')} verify steps, acceptance length {overall:.3f}; reference "
            f"{ref:.3f}, {source}). ")
    if not low:
        return {**meta, "where_served": "no group below the reference by more than the threshold"}, \
            head + f"No group is below it by more than {drop:.0%}."
    w = low[0]
    meta.update(where_served=f"{w['by']}={w['value']}", where_served_acceptance_length=w["acceptance_length"],
                where_served_share=w["share"])
    return meta, head + (f"Lowest: {w['by']} `{w['value']}` at {w['acceptance_length']:.3f} on {w['share']:.0%} of "
                         "those requests" + ("; also low: " + ", ".join(
                             f"{g['by']} `{g['value']}` {g['acceptance_length']:.3f}" for g in low[1:6])
                             if len(low) > 1 else "") + ".")


def _live_series(context, server: str, drafter: str | None) -> str:
    obs = [o for o in served.observations(context.instance, server, since=time.time() - 86400)
           if o.get("acceptance_length") is not None and o.get("drafter") == drafter]
    if not obs:
        return "no live figures in the last day"
    values = [float(o["acceptance_length"]) for o in obs]
    return (f"live acceptance length over the last day ({len(values)} windows): `{charts.sparkline(values)}` "
            f"first {values[0]:.3f}, last {values[-1]:.3f}, min {min(values):.3f}, max {max(values):.3f}")


LOAD_MOVED = 1.5  # the mean batch grew or shrank by this factor (and by a request at least): the load moved


def load_moved(context, server: str, window_s: float, now: float | None = None) -> tuple[dict, str]:
    """Whether the load moved with the traffic: the server's mean batch (requests running at once, by Little's law,
    live_acceptance.py) over the drift's window (ending at `now`, when the sensor saw it) against the day before it,
    each window weighted by its length. The report runs minutes later (after its replay): its own clock would
    measure a window the drift is not in."""
    now = time.time() if now is None else now
    obs = [o for o in served.observations(context.instance, server, since=now - 86400)
           if o.get("mean_requests_running") is not None and o.get("window_s")]

    def mean(picked):
        secs = sum(float(o["window_s"]) for o in picked)
        return (sum(float(o["mean_requests_running"]) * float(o["window_s"]) for o in picked) / secs, secs) \
            if secs else (None, 0)

    recent = mean([o for o in obs if now - window_s <= o["t"] <= now])
    before = mean([o for o in obs if o["t"] < now - window_s])
    if recent[0] is None:
        return {}, "**Load**: no load figures in the window (a server that is not vLLM, or no second read yet)."
    meta = {"mean_batch_in_window": round(recent[0], 3)}
    if before[0] is None:
        return meta, (f"**Load**: {recent[0]:.2f} requests running at once on average over the window; no load "
                      "figures from before it to compare.")
    lo, hi = sorted((recent[0], before[0]))
    moved = hi - lo >= 1 and hi >= lo * LOAD_MOVED
    meta.update(mean_batch_before=round(before[0], 3), load_moved="yes" if moved else "no")
    return meta, (f"**Load** ({'moved' if moved else 'steady'}): {recent[0]:.2f} requests running at once on average "
                  f"over the window, {before[0]:.2f} over the {before[1] / 3600:.1f} h observed before it"
                  + (": the acceptance fell as the load changed; the speculation schedule's k at the new batch sizes "
                     "is worth a look (speculation_schedule)." if moved else "."))


def report(context: dg.AssetExecutionContext, config: DriftReportConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The report: the signals, the served drafter's figures, and where the traffic's acceptance fell."""
    settings = drift_settings()
    rec = _replay(context, config)
    replay = served.meta(rec) if rec is not None else {}
    drafter = config.drafter or replay.get("drafter")
    ckpt = served.checkpoint(context.instance, drafter)
    fired, lines = [], []
    meta: dict = {"signal": config.signal, "server": config.server or "", "drafter": drafter or "unknown",
                  "checkpoint": ckpt or "not exported by this instance"}
    if config.live_acceptance_length is not None and config.benchmark_acceptance_length:
        live_drop = (config.benchmark_acceptance_length - config.live_acceptance_length) / \
            config.benchmark_acceptance_length
        meta.update(live_acceptance_length=round(config.live_acceptance_length, 4),
                    benchmark_acceptance_length=config.benchmark_acceptance_length,
                    live_drop=round(live_drop, 4), live_threshold=settings.live_drop)
        if config.signal == "live":
            fired.append("live")
            lines.append(f"**Live**: {config.server} served {config.num_drafts} speculative steps in the last "
                         f"{config.window_s} s at an acceptance length of {config.live_acceptance_length:.3f}, "
                         f"{live_drop:.1%} below the drafter's benchmarked {config.benchmark_acceptance_length:.3f} "
                         f"({config.benchmark_from}; threshold {settings.live_drop:.0%}).")
    signal = config.signal
    if config.signal == "collapse":  # suspected by the sensor: a collapse, or a drift to traffic never seen?
        facts = collapse.evidence(context.instance, config.server or "", ckpt, drafter)
        probed = collapse.probes(context.instance, gpu_host, config.server or "", drafter, settings, context.log.info)
        groups = served_day(context, config.traffic_day)[1].get("served_groups") or []
        is_collapse, why = collapse.verdict(facts, probed, groups, config.benchmark_acceptance_length, settings)
        signal = "collapse" if is_collapse else "live"
        fired.append(signal)
        meta.update(suspected="collapse", kind="collapse, not drift" if is_collapse else "drift, not collapse",
                    live_acceptance_length=round(config.live_acceptance_length or 0, 4),
                    evidence=dg.MetadataValue.json(facts), causes_found=len(collapse.causes(facts)),
                    probes=dg.MetadataValue.json(probed), verdict=why)
        if probed.get("acceptance_length") is not None:
            meta["probes_acceptance_length"] = probed["acceptance_length"]
        live = (config.server or "", config.num_drafts, config.window_s, config.live_acceptance_length or 0.0)
        lines.append(collapse.line(*live, facts, why) if is_collapse else collapse.drift_line(*live, why))
        meta["signal"] = signal
    if config.server:
        load_meta, load_line = load_moved(context, config.server, config.window_s or settings.window_s,
                                          config.observed_at)
        meta.update(load_meta)
        lines.append(load_line)
    reference = replay.get("eval_acceptance_length")
    if replay:
        meta.update(traffic_day=rec.event_log_entry.asset_materialization.partition,
                    traffic_acceptance_length=replay["acceptance_length"], eval_acceptance_length=reference,
                    offline_drop=replay.get("drop"), traffic_prompts_replayed=replay.get("prompts"))
        if replay.get("drift"):
            fired.append("offline")
        lines.append(f"**Offline** ({'fired' if replay.get('drift') else 'did not fire'}): replayed on "
                     f"{replay.get('prompts')} prompts of {meta['traffic_day']}'s traffic, acceptance length "
                     f"{replay['acceptance_length']:.3f} against {reference:.3f} on its eval set "
                     f"({replay.get('eval_reference')}): {replay.get('drop', 0):.1%} lower (threshold "
                     f"{settings.offline_drop:.0%})." if reference else "**Offline**: no eval figure to compare.")
    day_served, served_m = served_day(context, config.traffic_day) if signal != "collapse" else (None, {})
    if served_m:
        ref, source = ((config.benchmark_acceptance_length, config.benchmark_from) if config.benchmark_acceptance_length
                       else (reference, "its eval set"))
        served_meta, served_line = where_served(day_served, served_m, ref, source, settings.offline_drop)
        meta.update(served_meta)
        meta.setdefault("traffic_day", day_served)  # the day read, replayed or not
        lines.append(served_line)
    elif not replay and signal != "collapse":  # a collapse is not located in the traffic
        lines.append("**Where**: no traffic replay nor served figures to locate it: set EAGLE3_TRAFFIC_LOGS (or "
                     "materialize a `traffic` partition) and keep `drift.locate` on, or materialize "
                     "traffic_acceptance by hand; a gateway that logs each response with vLLM's per-request metrics "
                     "(--per-request-spec-decode-metrics summary) locates it without a replay.")
    low = where(replay.get("groups") or [], reference, settings.offline_drop)
    if low:
        w = low[0]
        meta.update(where=f"{w['by']}={w['value']}", where_acceptance_length=w["acceptance_length"],
                    where_share_of_traffic=w["share"], where_share_of_training=w["train_share"])
        lines.append(f"**Where**: {w['by']} `{w['value']}`: acceptance length {w['acceptance_length']:.3f} against "
                     f"{reference:.3f} on the eval set, {w['share']:.0%} of the traffic replayed, "
                     + (f"{w['train_share']:.1%} of the drafter's training prompts." if w["train_share"] is not None
                        else "its training prompts unknown here.")
                     + (" Also low: " + ", ".join(f"{g['by']} `{g['value']}` {g['acceptance_length']:.3f}"
                                                 for g in low[1:6]) if len(low) > 1 else ""))
    elif replay:
        meta["where"] = "no group of the traffic below the eval figure by more than the threshold"
    meta["signals_fired"] = ", ".join(fired) or "none"
    bench = served.benchmarks(context.instance, ckpt)
    section = ["", "### The served drafter", f"- drafter `{drafter}`, checkpoint `{str(ckpt)[:12]}`"]
    section += [f"- benchmark {time.strftime('%Y-%m-%d %H:%M', time.localtime(b['when']))}: {b['engine']} "
                f"{b['engine_version']}, acceptance length {fmt(b['acceptance_length'])}, speedup "
                + (f"{b['speedup']:.2f}x" if b["speedup"] is not None else "not measured")
                for b in bench[:5]] or ["- no serving_benchmark of this checkpoint in this instance"]
    if config.server:
        section.append(f"- {_live_series(context, config.server, drafter)}")
    tables = (["", "### Acceptance per group, as production served it (lowest first)", "",
               served_table(served_m.get("served_groups") or [], meta.get("served_reference"))] if served_m else [])
    tables += (["", "### Acceptance per group of the traffic, replayed (lowest first)", "",
                groups_table(replay.get("groups") or [], reference), "",
                "### The prompts of lowest acceptance (redacted, cut)", "", lowest_table(replay.get("lowest") or [])]
               if replay else [])
    report = "\n\n".join(lines) + "\n" + "\n".join(section + tables)
    context.log.warning(f"drift ({meta['signals_fired']}) for {config.server or drafter}: {meta.get('where', '')}")
    meta["report"] = dg.MetadataValue.md(report)
    return dg.MaterializeResult(metadata=meta)


def make_drift_report(live_keys: list[dg.AssetKey]) -> dg.AssetsDefinition:
    """The report asset, downstream of the replay and of every watched server's live acceptance."""

    @dg.asset(name="drift_report", group_name="serving", kinds={"dagster"}, deps=[TRAFFIC, REPLAY, *live_keys],
              output_required=False,
              code_version=code_version(__name__, "report"))
    def drift_report(context: dg.AssetExecutionContext, config: DriftReportConfig, gpu_host: GpuHost):
        """Where and by how much a served drafter stopped fitting its traffic: made by the live or the traffic drift
        sensor (drift.py) when a signal fires. A report of a live window that has passed, on a server whose state has
        moved on (a run that waited in the queue, a daemon restarted), is dropped, saying so."""
        if why := stale(context.instance, context.run.tags, config.server, config.observed_at, config.drafter):
            context.log.warning(f"drift report dropped: {why}")
            return
        yield report(context, config, gpu_host)

    return drift_report
