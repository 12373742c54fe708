"""What a production server serves, tied to this instance's records: the export a served drafter path is, the
checkpoint it was made from, that checkpoint's benchmark and offline figures, and the server's live observations
summed over a window. Read from Dagster's records only (the serving eye's sensors, its report and the CLI share it)."""

from __future__ import annotations

import json
import time
from pathlib import PurePosixPath

import dagster as dg

from .servers_file import Server, asset_key

INPUT_VERSION = "dagster/input_data_version/"
EXPORT, BENCHMARK, OFFLINE = dg.AssetKey("drafter_export"), dg.AssetKey("serving_benchmark"), dg.AssetKey("offline_acceptance")
DRAFTER = dg.AssetKey("eagle3_drafter")
# the loop's drafters: a challenger is exported by challenger_export and judged by promotion_gate
CHALLENGER_EXPORT, GATE = dg.AssetKey("challenger_export"), dg.AssetKey("promotion_gate")
ROLLOUT = dg.AssetKey("rollout")
SCAN = 500  # materializations looked through, newest first


def meta(rec) -> dict:
    return {k: v.value for k, v in rec.event_log_entry.asset_materialization.metadata.items()}


def _input_version(rec, asset: str) -> str | None:
    return (rec.event_log_entry.asset_materialization.tags or {}).get(INPUT_VERSION + asset)


def export_record(instance: dg.DagsterInstance, drafter: str | None):
    """The drafter_export (or the loop's challenger_export) materialization a served drafter path is: its path
    exactly, else a path holding its directory name (exports/<checkpoint[:12]>/<dialect>, kept when the export is
    copied to the serving machines)."""
    if not drafter:
        return None
    recs = sorted((r for key in (EXPORT, CHALLENGER_EXPORT) for r in instance.fetch_materializations(key, limit=SCAN).records),
                  key=lambda r: -r.storage_id)
    want = drafter.rstrip("/")
    for rec in recs:
        if any(str(v).rstrip("/") == want for k, v in meta(rec).items() if k.endswith("_path")):
            return rec
    parts = set(PurePosixPath(want).parts)
    for rec in recs:
        names = {PurePosixPath(str(v)).parent.name for k, v in meta(rec).items() if k.endswith("_path")}
        if names & parts:
            return rec
    return None


def checkpoint(instance: dg.DagsterInstance, drafter: str | None) -> str | None:
    """The checkpoint a drafter path holds (the eagle3_drafter or challenger_drafter data version an export was made
    from, or a trained checkpoint's own); None for a drafter this instance did not make."""
    rec = export_record(instance, drafter)
    if rec is not None:
        return _input_version(rec, "eagle3_drafter") or _input_version(rec, "challenger_drafter")
    for rec in instance.fetch_materializations(DRAFTER, limit=SCAN).records if drafter else []:
        if str(meta(rec).get("path", "")).rstrip("/") in (drafter.rstrip("/"), str(PurePosixPath(drafter).parent)):
            return (rec.event_log_entry.asset_materialization.tags or {}).get("dagster/data_version")
    return None


def benchmarks(instance: dg.DagsterInstance, ckpt: str | None, engine: str | None = None) -> list[dict]:
    """serving_benchmark results of one checkpoint (on one engine), newest first."""
    if not ckpt:
        return []
    out = []
    for rec in instance.fetch_materializations(BENCHMARK, limit=SCAN).records:
        m = meta(rec)
        on = m.get("engine", rec.event_log_entry.asset_materialization.partition)
        if m.get("checkpoint") == ckpt and (engine is None or on == engine):
            out.append({"storage_id": rec.storage_id, "when": rec.timestamp, "engine": m.get("engine"),
                        "engine_version": m.get("engine_version"), "acceptance_length": m.get("acceptance_length"),
                        "speedup": m.get("speedup"), "num_speculative_tokens": m.get("num_speculative_tokens"),
                        "acceptance_per_pos": m.get("acceptance_per_pos"),
                        "prompt_set": m.get("prompt_set"), "run_id": rec.run_id})
    return out


def offline_figure(instance: dg.DagsterInstance, ckpt: str | None, k: int, max_new_tokens: int,
                   eval_path: str) -> dict | None:
    """offline_acceptance of the checkpoint on the eval set, at the same k and reply length (run config), or None."""
    if not ckpt:
        return None
    for rec in instance.fetch_materializations(OFFLINE, limit=SCAN).records:
        m = meta(rec)
        run = instance.get_run_by_id(rec.run_id)
        cfg = (((run.run_config or {}).get("ops") or {}).get("offline_acceptance") or {}).get("config") or {} if run else {}
        if _input_version(rec, "eagle3_drafter") == ckpt and m.get("num_speculative_tokens") == k and \
                cfg.get("max_new_tokens", max_new_tokens) == max_new_tokens and str(m.get("eval_set", "")).endswith(eval_path):
            return {"acceptance_length": m["acceptance_length"], "storage_id": rec.storage_id, "prompts": m.get("prompts")}
    return None


def observations(instance: dg.DagsterInstance, server: str, since: float | None = None, limit: int = 5000) -> list[dict]:
    """A server's live observations, oldest first: {"t": timestamp, **metadata}."""
    recs = instance.fetch_observations(asset_key(server), limit=limit).records  # newest first
    out = []
    for r in recs:
        if since is not None and r.timestamp < since:
            break
        out.append({"t": r.timestamp, **{k: v.value for k, v in r.event_log_entry.asset_observation.metadata.items()}})
    return out[::-1]


def serving_now(obs: list[dict]) -> str | None:
    """The drafter the newest read of a server named."""
    return next((o["drafter"] for o in reversed(obs) if o.get("drafter")), None)


def window(obs: list[dict], drafter: str | None, since: float) -> dict:
    """Acceptance over every speculative step the observations since `since` counted for `drafter` (windows of
    steady counting, or since a restart; not a first read, whose span is unknown)."""
    picked = [o for o in obs if o["t"] >= since and o.get("num_drafts") and o.get("drafter") == drafter
              and (o.get("status") == "ok" or str(o.get("status", "")).startswith("restarted"))]
    drafts = sum(o["num_drafts"] for o in picked)
    accepted = sum(o.get("num_accepted_tokens", 0) for o in picked)
    per_pos = [json.loads(o["acceptance_per_pos"]) for o in picked if o.get("acceptance_per_pos")]
    k = len(per_pos[-1]) if per_pos else None
    pos = [sum(p[i] * o["num_drafts"] for p, o in zip(per_pos, picked) if len(p) > i) / drafts for i in range(k or 0)] \
        if drafts else []
    return {"num_drafts": drafts, "num_accepted_tokens": accepted, "observations": len(picked), "k": k,
            "acceptance_length": 1 + accepted / drafts if drafts else None, "acceptance_per_pos": pos,
            "since": since, "until": picked[-1]["t"] if picked else None}


def gate_figure(instance: dg.DagsterInstance, ckpt: str | None, engine: str) -> dict | None:
    """The newest promotion gate's eval figure of a checkpoint that was its challenger or its champion (a drafter
    the loop made has no serving_benchmark, and the gate served it at production settings): {acceptance_length,
    k, max_new_tokens, label, when, run_id}, or None."""
    if not ckpt:
        return None
    for rec in instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=GATE, asset_partitions=[engine]),
                                               limit=50).records:
        m = meta(rec)
        for label in ("challenger", "champion"):
            got = (((m.get("figures") or {}).get(label) or {}).get("eval") or {}).get("acceptance_length")
            if m.get(label) == ckpt and got is not None:
                return {"acceptance_length": float(got), "k": m.get("num_speculative_tokens"), "label": label,
                        "max_new_tokens": m.get("max_new_tokens"), "when": rec.timestamp, "run_id": rec.run_id}
    return None


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def describe(instance: dg.DagsterInstance, server: Server, drafter: str | None) -> dict:
    """What the served drafter is in this instance: its checkpoint and the figure its live acceptance is held to:
    its newest serving_benchmark on the server's engine, else (a drafter the loop promoted) the newest promotion
    gate's eval figure for it, else the servers file's figure."""
    ckpt = checkpoint(instance, drafter)
    bench = benchmarks(instance, ckpt, server.engine)
    out = {"checkpoint": ckpt, "benchmark_acceptance_length": None, "benchmark_k": None, "benchmark_from": None,
           "benchmark_acceptance_per_pos": None, "benchmark_prompt_set": None}
    gate = None if bench and bench[0]["acceptance_length"] is not None else gate_figure(instance, ckpt, server.engine)
    if bench and bench[0]["acceptance_length"] is not None:
        out.update(benchmark_acceptance_length=float(bench[0]["acceptance_length"]),
                   benchmark_k=bench[0]["num_speculative_tokens"],
                   benchmark_acceptance_per_pos=[float(p) for p in bench[0]["acceptance_per_pos"] or []] or None,
                   benchmark_prompt_set=bench[0]["prompt_set"],
                   benchmark_from=f"serving_benchmark {_when(bench[0]['when'])} (run {bench[0]['run_id'][:8]})")
    elif gate is not None:
        out.update(benchmark_acceptance_length=gate["acceptance_length"], benchmark_k=gate["k"],
                   benchmark_from=f"promotion_gate {_when(gate['when'])} (run {gate['run_id'][:8]}): the "
                                  f"{gate['label']}'s acceptance on the eval set, k={gate['k']}, "
                                  f"{gate['max_new_tokens']} new tokens")
    elif server.benchmark_acceptance_length is not None:
        out.update(benchmark_acceptance_length=server.benchmark_acceptance_length,
                   benchmark_from="the servers file (benchmark_acceptance_length)")
    return out


def rolled_out(instance: dg.DagsterInstance, server: str) -> str | None:
    """The drafter the newest rollout that touched `server` left on it, or None."""
    for rec in instance.fetch_materializations(ROLLOUT, limit=20).records:
        got = (meta(rec).get("servers") or {}).get(server)
        if got and got.get("drafter"):
            return got["drafter"]
    return None
