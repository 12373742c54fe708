from typing import Literal

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..hosts import GpuHost
from .conversations import OUT as CONVERSATIONS
from .partitions import shard_partitions
from .upstream import upstream_metadata

OUT_DIR = "hidden_states"


class HiddenStatesConfig(dg.Config):
    backend: Literal["hf", "vllm", "sglang"] = Field(
        default="hf", description="hf: a transformers forward in the worker, the whole target on one device (targets "
                                  "one GPU holds); vllm: the target served by vLLM on the host with tensor/data "
                                  "parallelism and our KV connector writing the shard (targets no single GPU holds); "
                                  "sglang: SGLang's model runner, tensor/data parallel (held to SGLang 0.5.14, not run here)")
    engine_python: str | None = Field(default=None, description="vllm/sglang: the host Python with the engine")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vllm: GPUs per engine (8 for Kimi-K2.5 on 8xH200)")
    data_parallel_size: int = Field(default=1, ge=1, description="vllm: engines on the host, each tensor_parallel_size GPUs")
    extra_args: list[str] = Field(default=[], description="vllm: more server arguments (--gpu-memory-utilization ...)")
    env: dict[str, str] = Field(default={}, description="vllm: server environment (VLLM_* settings)")
    concurrency: int = Field(default=32, ge=1, description="vllm: samples in flight")
    ready_timeout_s: float = Field(default=1800, gt=0, description="vllm: how long the server may take to load the target")
    aux_layers: list[int] | None = Field(
        default=None, description="3 decoder layer ids, 'output of layer i' convention (HF hidden_states[i+1]). "
                                  "Empty: [1, N//2-1, N-4], which vLLM's and SGLang's defaults also capture")
    max_length: int = Field(default=2048, description="tokens per sample; longer samples are truncated")
    batch_tokens: int = Field(default=16384, description="padded tokens per forward batch")
    part_bytes: int = Field(default=1 << 30, description="target size of one safetensors part file")
    io_threads: int = Field(default=4, description="threads writing and hashing parts")
    dtype: str = Field(default="auto", description="auto: bfloat16 on a GPU or a CPU with bf16 instructions, else float32")
    storage: Literal["native", "fp8"] = Field(default="native", description="native: hidden states in the compute "
                                              "dtype (format v1); fp8: float8 e4m3 with one scale per token and "
                                              "layer (format v2, half of bf16 on disk)")


@dg.asset(group_name="data", kinds={"pytorch", "safetensors"}, partitions_def=shard_partitions,
          deps=["conversations", "target_model"], pool="gpu_host",
          code_version=code_version(__name__, "hidden_state_shards"))
def hidden_state_shards(context: dg.AssetExecutionContext, config: HiddenStatesConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """Per shard: the target's 3 aux-layer hidden states and final pre-norm hidden state for every token,
    as safetensors parts + a Parquet index on the host, from a transformers forward (`hf`) or from the serving
    engine (`vllm`, tensor parallel). The value is the shard's manifest."""
    conv = upstream_metadata(context, "conversations")
    target = upstream_metadata(context, "target_model")["path"]
    run = gpu_host.run_stage(context, "extract", {
        "target": target, "conversations": CONVERSATIONS, "out_dir": OUT_DIR,
        "shard": int(context.partition_key), "samples_per_shard": int(conv["samples_per_shard"]),
        "aux_layers": config.aux_layers, "max_length": config.max_length, "batch_tokens": config.batch_tokens,
        "part_bytes": config.part_bytes, "io_threads": config.io_threads, "dtype": config.dtype,
        "storage": config.storage, "backend": config.backend, "engine_python": config.engine_python,
        "tensor_parallel_size": config.tensor_parallel_size, "data_parallel_size": config.data_parallel_size,
        "extra_args": config.extra_args, "env": config.env, "concurrency": config.concurrency,
        "ready_timeout_s": config.ready_timeout_s,
    })
    return run.materialize_result()
