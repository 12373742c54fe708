"""traffic_acceptance: the offline drift signal. A drafter's acceptance on a day of served prompts (the `traffic`
partition), by our own replay on the target (stage `traffic_replay`), per group of prompts, against its acceptance on
the eval set it was measured on when trained. Its check `fits_traffic` fails when the traffic's figure is lower by
more than the servers file's `drift.offline_drop`; the traffic drift sensor (drift.py) turns that into a report."""

import hashlib
import time

import dagster as dg
from pydantic import Field

from ..assets.paths import CONVERSATIONS, EVAL
from ..assets.upstream import upstream_metadata
from ..code_versions import code_version
from ..common.engines import DEFAULT
from ..hosts import GpuHost
from ..stages.traffic_replay import TrafficReplaySettings
from . import served
from .drift import stale
from .servers_file import drift_settings
from .traffic import TRAFFIC_DIR, traffic_partitions

FITS = "fits_traffic"
REPLAY_DIR = "traffic_acceptance"  # <day>/<checkpoint or drafter hash>-<time>.parquet: per-prompt results


class TrafficAcceptanceConfig(dg.Config, TrafficReplaySettings):
    """The traffic_replay stage's settings (eagle3_assets/stages/traffic_replay.py) and which drafter it replays."""

    drafter: str | None = Field(default=None, description="the drafter to replay, a path on the host (an export, "
                                "as a server serves it, or a trained checkpoint); None: the newest drafter_export")
    server: str | None = Field(default=None, description="the production server serving it, for the record")


def _current_drafter(context) -> str:
    export = upstream_metadata(context, "drafter_export")
    path = export.get(f"{DEFAULT}_path") or next((v for k, v in export.items() if k.endswith("_path")), None)
    if path is None:
        raise dg.Failure(description="drafter_export holds no export path: materialize drafter_export, or set "
                                     "traffic_acceptance's `drafter`")
    return str(path)


@dg.asset(group_name="serving", kinds={"pytorch"}, partitions_def=traffic_partitions, pool="gpu_host",
          deps=["traffic", "drafter_export", "target_model", "conversations", "prompts"], output_required=False,
          code_version=code_version(__name__, "traffic_acceptance"),
          check_specs=[dg.AssetCheckSpec(FITS, asset="traffic_acceptance", description="the drafter's acceptance on "
                                         "the day's traffic within drift.offline_drop of its figure on its eval set")])
def traffic_acceptance(context: dg.AssetExecutionContext, config: TrafficAcceptanceConfig, gpu_host: GpuHost):
    """The drafter's acceptance on a day of traffic (its seeded sample, already redacted), by replay speculation on
    the target: overall, per kind / length / first words of the prompts, the prompts of lowest acceptance, and its
    acceptance on its eval set beside it (offline_acceptance's, when it measured the same checkpoint at the same
    settings; else replayed in the same run). In a live drift's report run that waited past its window for a server
    that has moved on, nothing is replayed and the report is dropped (drift.stale)."""
    report = (((context.run.run_config or {}).get("ops") or {}).get("drift_report") or {}).get("config") or {}
    if why := stale(context.instance, context.run.tags, report.get("server"), report.get("observed_at"),
                    report.get("drafter")):
        context.log.warning(f"not replayed, and the drift report after it dropped: {why}")
        yield dg.AssetCheckResult(check_name=FITS, passed=False, severity=dg.AssetCheckSeverity.WARN,
                                  description=f"not replayed: {why}")
        return
    day = context.partition_key
    drafter = config.drafter or _current_drafter(context)
    ckpt = served.checkpoint(context.instance, drafter)
    k, new = config.num_speculative_tokens, config.max_new_tokens
    recorded = served.offline_figure(context.instance, ckpt, k, new, EVAL)
    settings = config.model_dump(include=set(TrafficReplaySettings.model_fields))
    tag = (ckpt or hashlib.sha256(drafter.encode()).hexdigest())[:12]
    run = gpu_host.run_stage(context, "traffic_replay", {
        "target": upstream_metadata(context, "target_model")["path"], "drafter": drafter,
        "traffic": f"{TRAFFIC_DIR}/{day}.parquet", "eval_prompts": None if recorded else EVAL,
        "training": [CONVERSATIONS], "out": f"{REPLAY_DIR}/{day}/{tag}-{time.strftime('%Y%m%d-%H%M%S')}.parquet",
        **settings})
    m = run.result
    reference = recorded["acceptance_length"] if recorded else m.get("eval_acceptance_length")
    limit = drift_settings().offline_drop
    drop = round((reference - m["acceptance_length"]) / reference, 4) if reference else None
    drift = drop is not None and drop > limit
    kinds = {g["value"]: g["acceptance_length"] for g in m["groups"] if g["by"] == "kind"}
    extra = {
        "day": day, "drafter": drafter, "checkpoint": ckpt or "not exported by this instance",
        "server": config.server or "", "eval_acceptance_length": reference,
        "eval_reference": (f"offline_acceptance (storage id {recorded['storage_id']}, {recorded['prompts']} prompts)"
                           if recorded else f"replayed here on {m.get('eval_prompts')} eval prompts"),
        "drop": drop, "offline_drop": limit, "drift": drift,
        **{f"acceptance_length_{kind.replace('-', '_')}": al for kind, al in kinds.items() if al is not None},
        "groups_table": dg.MetadataValue.md(groups_table(m["groups"], reference)),
        "lowest_table": dg.MetadataValue.md(lowest_table(m["lowest"])),
    }
    result = run.materialize_result(**extra)
    check = dg.AssetCheckResult(
        check_name=FITS, passed=not drift, severity=dg.AssetCheckSeverity.WARN,
        metadata={"traffic_acceptance_length": m["acceptance_length"], "eval_acceptance_length": reference or 0.0,
                  "drop": drop if drop is not None else 0.0, "offline_drop": limit},
        description=(f"acceptance length {m['acceptance_length']:.3f} on {day}'s traffic, {drop:.1%} below its "
                     f"{reference:.3f} on the eval set (limit {limit:.0%})" if reference else "no eval figure to compare"))
    yield dg.MaterializeResult(metadata=result.metadata, data_version=result.data_version, check_results=[check])


def fmt(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def groups_table(groups: list[dict], reference: float | None) -> str:
    """The groups, lowest acceptance first, as a Markdown table."""
    lines = ["| by | group | prompts | share of traffic | acceptance length | vs eval | eval, same group | "
             "share of training |", "|---|---|---|---|---|---|---|---|"]
    for g in groups:
        vs = f"{(g['acceptance_length'] - reference) / reference:+.1%}" if reference and g["acceptance_length"] else "-"
        train = "-" if g["train_share"] is None else f"{g['train_share']:.1%}"
        lines.append(f"| {g['by']} | {g['value']} | {g['prompts']} | {g['share']:.0%} | {fmt(g['acceptance_length'])} "
                     f"| {vs} | {fmt(g['eval_acceptance_length'])} | {train} |")
    return "\n".join(lines)


def lowest_table(lowest: list[dict]) -> str:
    """The prompts of lowest acceptance (their redacted text, cut), with their nearest training prompt's similarity."""
    lines = ["| acceptance length | kind | length | nearest training prompt (Jaccard) | prompt (redacted, cut) |",
             "|---|---|---|---|---|"]
    for p in lowest:
        text = " ".join(str(p["preview"]).split()).replace("|", "\\|")[:120]
        lines.append(f"| {fmt(p['acceptance_length'])} | {p['kind']} | {p['length_bucket']} | "
                     f"{fmt(p.get('nearest_training_similarity'))} | {text} |")
    return "\n".join(lines)
