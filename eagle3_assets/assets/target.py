
import dagster as dg

from ..code_versions import code_version
from ..hosts import GpuHost
from ..stages.prepare_target import PrepareTargetSettings


class TargetModelConfig(dg.Config, PrepareTargetSettings):
    """The prepare_target stage's settings (eagle3_assets/stages/prepare_target.py)."""


@dg.asset(group_name="data", kinds={"pytorch"}, code_version=code_version(__name__, "target_model"))
def target_model(context: dg.AssetExecutionContext, config: TargetModelConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The target LLM the drafter will speed up: a HF model directory on the host. Data version = hash of
    its weights, so every downstream result is tied to the exact weights."""
    run = gpu_host.run_stage(context, "prepare_target", config.model_dump())
    return run.materialize_result()
