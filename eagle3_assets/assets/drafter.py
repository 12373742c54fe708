"""eagle3_drafter: the EAGLE-3 draft head trained on the hidden-state shards (stage `train`), or online on the
target's hidden states computed as it trains (`hidden_states: online`: no shard needed, none written)."""

import os

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..common.engines import DEFAULT, NAMES
from ..hosts import GpuHost, Held
from ..stages.train import TrainSettings
from .integration import gate_state
from .partitions import shard_partitions
from .paths import CONVERSATIONS, DRAFTER_DIR, SHARDS_DIR, VOCAB
from .upstream import upstream_metadata

GATE_ENV = "EAGLE3_INTEGRATION_GATE"  # require | skip: the default of integration_gate on this deployment


class DrafterConfig(dg.Config, TrainSettings):
    """The train stage's settings (eagle3_assets/stages/train.py). Pydantic checks their bounds as the step
    starts, before the asset runs anything: Dagster's config schema (what the launchpad checks) carries types
    only."""

    integration_gate: str | None = Field(
        default=None, description="require: train only once integration_check passed for integration_engine (a "
        f"failed or missing gate refuses the run); skip: train anyway, recorded in the metadata. None: ${GATE_ENV}, "
        "else require")
    integration_engine: str = Field(default=DEFAULT, description="the engine the drafter is for: its "
                                    "integration_check partition must have passed (" + ", ".join(NAMES) + ")")


_GATE_FIELDS = {"integration_gate", "integration_engine"}


def _gate(context: dg.AssetExecutionContext, config: DrafterConfig) -> str:
    """Before a long training: the integration gate's verdict for the engine, or a Failure saying what to do."""
    choice = config.integration_gate or os.environ.get(GATE_ENV) or "require"
    if choice not in ("require", "skip"):
        raise dg.Failure(description=f"integration_gate (or ${GATE_ENV}) is {choice!r}: set it to require or skip")
    if choice == "skip":
        return f"skipped (integration_gate skip): the {config.integration_engine} integration was not checked"
    if config.integration_engine not in NAMES:
        raise dg.Failure(description=f"integration_engine must be one of {list(NAMES)}, got {config.integration_engine!r}")
    passed, why = gate_state(context.instance, config.integration_engine)
    if passed is None:
        raise dg.Failure(description=f"{why}: materialize integration_drafter, then integration_check partition "
                                     f"{config.integration_engine}, before the full training (minutes instead of hours "
                                     "to learn that the engine cannot serve it); or set integration_gate: skip",
                         allow_retries=False)
    if not passed:
        raise dg.Failure(description=f"integration_check failed for {config.integration_engine}, so the full training "
                                     f"does not start: {why}\n\nFix that, rematerialize integration_check, then train; "
                                     "or set integration_gate: skip", allow_retries=False)
    return f"passed for {config.integration_engine}: {why}"


def _shards(context: dg.AssetExecutionContext, required: bool = True) -> list[Held]:
    """The shards to train on; not `required` (hidden_states auto): none unless every partition is materialized."""
    keys = context.instance.get_dynamic_partitions(shard_partitions.name)
    done = context.instance.get_materialized_partitions(dg.AssetKey("hidden_state_shards"))
    missing = [k for k in keys if k not in done]
    if not required and (not keys or missing):
        return []
    if not keys or missing:
        raise dg.Failure(description=f"hidden_state_shards partitions {missing or '(none registered)'} are not "
                                     "materialized: backfill hidden_state_shards first")
    return [Held("hidden_state_shards", f"{SHARDS_DIR}/shard-{k}", partition=k) for k in keys]


def _extract_settings(context: dg.AssetExecutionContext) -> dict:
    """Online, the target's hidden states are computed at the aux layers hidden_state_shards last extracted (the
    stage's own default, a finetune's layers or the extraction's, when it never ran)."""
    recs = context.instance.fetch_materializations(dg.AssetKey("hidden_state_shards"), limit=1).records
    aux = recs[0].event_log_entry.asset_materialization.metadata.get("aux_layer_ids") if recs else None
    return {"aux_layers": list(aux.value)} if aux is not None else {}


@dg.asset(group_name="drafter", kinds={"pytorch"}, pool="gpu_host",
          deps=["hidden_state_shards", "conversations", "vocab_mapping", "target_model", "integration_check"],
          code_version=code_version(__name__, "eagle3_drafter"))
def eagle3_drafter(context: dg.AssetExecutionContext, config: DrafterConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The trained EAGLE-3 draft head (canonical checkpoint under drafter/<run_name>/model). Data version =
    hash of the saved weights: every export and benchmark downstream names the exact checkpoint. In a pool of
    hosts it trains on the run's host, after copying there the shards other hosts hold. It starts only once
    the integration gate (integration_check) passed for the engine it is for, unless told to skip it."""
    gate = _gate(context, config)
    context.log.info(f"integration gate: {gate}")
    target = upstream_metadata(context, "target_model")["path"]
    mode = config.hidden_states
    shards = [] if mode == "online" else _shards(context, required=mode == "offline")
    convs = [] if mode == "offline" else [Held("conversations", CONVERSATIONS)]
    here = gpu_host.bring(context, [*shards, *convs, Held("vocab_mapping", VOCAB), Held("target_model", target)])
    args = {"target": here[target], "shards": [here[s.path] for s in shards], "vocab": here[VOCAB],
            "out": f"{DRAFTER_DIR}/{config.run_name}", **config.model_dump(exclude=_GATE_FIELDS)}
    if convs:
        args.update(conversations=here[CONVERSATIONS], **_extract_settings(context))
    return gpu_host.run_stage(context, "train", args).materialize_result(integration_gate=gate)
