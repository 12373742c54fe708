
import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..hosts import GpuHost
from ..stages.export import ExportSettings
from ..stages.speculate import SpeculateSettings
from ..stages.train import TrainSettings
from .hidden_states import OUT_DIR as SHARDS_DIR
from .partitions import shard_partitions
from .prompts import PROMPT_SETS
from .upstream import upstream_metadata
from .vocab import OUT as VOCAB

DRAFTER_DIR = "drafter"
EXPORT_DIR = "exports"


class DrafterConfig(dg.Config, TrainSettings):
    """The train stage's settings (eagle3_assets/stages/train.py). Pydantic checks their bounds as the step
    starts, before the asset runs anything: Dagster's config schema (what the launchpad checks) carries types
    only."""


def _shard_dirs(context: dg.AssetExecutionContext) -> list[str]:
    keys = context.instance.get_dynamic_partitions(shard_partitions.name)
    done = context.instance.get_materialized_partitions(dg.AssetKey("hidden_state_shards"))
    missing = [k for k in keys if k not in done]
    if not keys or missing:
        raise dg.Failure(description=f"hidden_state_shards partitions {missing or '(none registered)'} are not "
                                     "materialized: backfill hidden_state_shards first")
    return [f"{SHARDS_DIR}/shard-{k}" for k in keys]


@dg.asset(group_name="drafter", kinds={"pytorch"}, deps=["hidden_state_shards", "vocab_mapping", "target_model"],
          pool="gpu_host", code_version=code_version(__name__, "eagle3_drafter"))
def eagle3_drafter(context: dg.AssetExecutionContext, config: DrafterConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The trained EAGLE-3 draft head (canonical checkpoint under drafter/<run_name>/model). Data version =
    hash of the saved weights: every export and benchmark downstream names the exact checkpoint."""
    target = upstream_metadata(context, "target_model")["path"]
    args = {"target": target, "shards": _shard_dirs(context), "vocab": VOCAB,
            "out": f"{DRAFTER_DIR}/{config.run_name}", **config.model_dump()}
    return gpu_host.run_stage(context, "train", args).materialize_result()


class ExportConfig(dg.Config, ExportSettings):
    """The export stage's settings (eagle3_assets/stages/export.py)."""


@dg.asset(group_name="drafter", kinds={"safetensors"}, deps=["eagle3_drafter", "target_model"],
          code_version=code_version(__name__, "drafter_export"))
def drafter_export(context: dg.AssetExecutionContext, config: ExportConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The drafter as vLLM and SGLang load it (exports/<version>/{vllm,sglang}), each validated against its
    contract: names, shapes, dtypes, config fields, and which target layers the engine will capture."""
    drafter = upstream_metadata(context, "eagle3_drafter")
    target = upstream_metadata(context, "target_model")["path"]
    version = context.instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter")).asset_materialization.tags.get(
        "dagster/data_version", "latest")
    run = gpu_host.run_stage(context, "export", {"drafter": drafter["path"], "target": target,
                                                 "out": f"{EXPORT_DIR}/{version[:12]}", **config.model_dump()})
    return run.materialize_result()


class OfflineAcceptanceConfig(dg.Config, SpeculateSettings):
    """The speculate stage's settings (eagle3_assets/stages/speculate.py), on the prompts of one eval set."""

    eval_set: str = Field(default="eval", description="eval (held-out split) or humaneval")


@dg.asset(group_name="drafter", kinds={"pytorch"}, deps=["eagle3_drafter", "prompts", "target_model"],
          pool="gpu_host", code_version=code_version(__name__, "offline_acceptance"))
def offline_acceptance(context: dg.AssetExecutionContext, config: OfflineAcceptanceConfig,
                       gpu_host: GpuHost) -> dg.MaterializeResult:
    """Our own greedy chain speculative decoding on held-out prompts: acceptance length, per-position
    acceptance, and whether the output equals the target's greedy output. The reference for engine numbers."""
    if config.eval_set not in PROMPT_SETS:
        raise dg.Failure(description=f"eval_set must be one of {sorted(PROMPT_SETS)}, got {config.eval_set!r}")
    drafter = upstream_metadata(context, "eagle3_drafter")
    target = upstream_metadata(context, "target_model")["path"]
    run = gpu_host.run_stage(context, "speculate", {
        "target": target, "drafter": drafter["path"], "prompts": PROMPT_SETS[config.eval_set],
        **config.model_dump(exclude={"eval_set"})})
    return run.materialize_result()
