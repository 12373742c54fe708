from typing import Optional

import dagster as dg
from pydantic import Field

from ..hosts import GpuHost
from .conversations import OUT as CONVERSATIONS
from .partitions import shard_partitions
from .upstream import upstream_metadata

OUT_DIR = "hidden_states"


class HiddenStatesConfig(dg.Config):
    aux_layers: Optional[list[int]] = Field(
        default=None, description="3 decoder layer ids, 'output of layer i' convention (HF hidden_states[i+1]). "
                                  "Empty: [1, N//2-1, N-4], which vLLM's and SGLang's defaults also capture")
    max_length: int = Field(default=2048, description="tokens per sample; longer samples are truncated")
    batch_tokens: int = Field(default=16384, description="padded tokens per forward batch")
    part_bytes: int = Field(default=1 << 30, description="target size of one safetensors part file")
    io_threads: int = Field(default=4, description="threads writing and hashing parts")
    dtype: str = "bfloat16"


@dg.asset(group_name="data", kinds={"pytorch", "safetensors"}, partitions_def=shard_partitions,
          deps=["conversations", "target_model"], pool="gpu_host", code_version="1")
def hidden_state_shards(context: dg.AssetExecutionContext, config: HiddenStatesConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """Per shard: the target's 3 aux-layer hidden states and final pre-norm hidden state for every token,
    as safetensors parts + a Parquet index on the host. The value is the shard's manifest."""
    conv = upstream_metadata(context, "conversations")
    target = upstream_metadata(context, "target_model")["path"]
    run = gpu_host.run_stage(context, "extract", {
        "target": target, "conversations": CONVERSATIONS, "out_dir": OUT_DIR,
        "shard": int(context.partition_key), "samples_per_shard": int(conv["samples_per_shard"]),
        "aux_layers": config.aux_layers, "max_length": config.max_length, "batch_tokens": config.batch_tokens,
        "part_bytes": config.part_bytes, "io_threads": config.io_threads, "dtype": config.dtype,
    })
    return run.materialize_result()
