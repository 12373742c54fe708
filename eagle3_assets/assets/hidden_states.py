import dagster as dg

from ..code_versions import code_version
from ..hosts import GpuHost, Held
from ..stages.extract import ExtractSettings
from .partitions import shard_partitions
from .paths import CONVERSATIONS
from .paths import SHARDS_DIR as OUT_DIR
from .upstream import upstream_metadata


class HiddenStatesConfig(dg.Config, ExtractSettings):
    """The extract stage's settings (eagle3_assets/stages/extract.py)."""


@dg.asset(group_name="data", kinds={"pytorch", "safetensors"}, partitions_def=shard_partitions,
          deps=["conversations", "target_model"], pool="gpu_host",
          code_version=code_version(__name__, "hidden_state_shards"))
def hidden_state_shards(context: dg.AssetExecutionContext, config: HiddenStatesConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """Per shard: the target's 3 aux-layer hidden states and final pre-norm hidden state for every token,
    as safetensors parts + a Parquet index on the host, from a transformers forward (`hf`) or from the serving
    engine (`vllm`, tensor parallel). The value is the shard's manifest; `host` says which host holds it."""
    conv = upstream_metadata(context, "conversations")
    target = upstream_metadata(context, "target_model")["path"]
    here = gpu_host.bring(context, shard_inputs(target))  # on another host of a pool: copied there first
    run = gpu_host.run_stage(context, "extract", {
        "target": here[target], "conversations": here[CONVERSATIONS], "out_dir": OUT_DIR,
        "shard": int(context.partition_key), "samples_per_shard": int(conv["samples_per_shard"]),
        **config.model_dump()})
    return run.materialize_result()


def shard_inputs(target: str) -> list[Held]:
    """What a shard's extraction reads that other assets made (a host that lacks them cannot extract it)."""
    return [Held("conversations", CONVERSATIONS), Held("target_model", target)]
