import dagster as dg

from ..code_versions import code_version
from ..hosts import GpuHost
from ..stages.vocab import VocabSettings
from .paths import CONVERSATIONS
from .paths import VOCAB as OUT
from .upstream import upstream_metadata


class VocabConfig(dg.Config, VocabSettings):
    """The vocab stage's settings (eagle3_assets/stages/vocab.py)."""


@dg.asset(group_name="data", kinds={"safetensors"}, deps=["conversations", "target_model"],
          code_version=code_version(__name__, "vocab_mapping"))
def vocab_mapping(context: dg.AssetExecutionContext, config: VocabConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The draft vocabulary: `d2t` (offsets, target id = i + d2t[i]) and `t2d` (bool over the target vocab),
    from the frequencies of assistant tokens in the regenerated conversations."""
    target = upstream_metadata(context, "target_model")["path"]
    run = gpu_host.run_stage(context, "vocab", {"target": target, "conversations": CONVERSATIONS, "out": OUT,
                                                **config.model_dump()})
    return run.materialize_result()
