import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..hosts import GpuHost
from .conversations import OUT as CONVERSATIONS
from .upstream import upstream_metadata

OUT = "vocab/vocab_mapping.safetensors"


class VocabConfig(dg.Config):
    draft_vocab_size: int = Field(default=32000, gt=0, description="capped at the target's vocab size")


@dg.asset(group_name="data", kinds={"safetensors"}, deps=["conversations", "target_model"],
          code_version=code_version(__name__, "vocab_mapping"))
def vocab_mapping(context: dg.AssetExecutionContext, config: VocabConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The draft vocabulary: `d2t` (offsets, target id = i + d2t[i]) and `t2d` (bool over the target vocab),
    from the frequencies of assistant tokens in the regenerated conversations."""
    target = upstream_metadata(context, "target_model")["path"]
    run = gpu_host.run_stage(context, "vocab", {"target": target, "conversations": CONVERSATIONS, "out": OUT,
                                                "draft_vocab_size": config.draft_vocab_size})
    return run.materialize_result()
