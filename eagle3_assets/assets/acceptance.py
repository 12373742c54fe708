"""offline_acceptance: our own speculative decoding with the drafter on held-out prompts (stage `speculate`)."""

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..hosts import GpuHost
from ..stages.speculate import SpeculateSettings
from .paths import PROMPT_SETS
from .upstream import upstream_metadata


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
