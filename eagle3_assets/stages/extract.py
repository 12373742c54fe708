"""Stage `extract`: one hidden-state shard (aux layers + final hidden state per token) of the conversations."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..common.shard_format import DEFAULT_STORAGE
from .base import DTYPE_HELP, NAMES, Args, Contract, EngineLaunch


class ExtractSettings(EngineLaunch):
    backend: Literal[("hf", *NAMES)] = Field(
        default="hf", description="hf: a transformers forward in the worker, the whole target on one device (targets "
                                  "one GPU holds); vllm: the target served by vLLM on the host with tensor/data "
                                  "parallelism and our KV connector writing the shard (targets no single GPU holds); "
                                  "sglang: SGLang's model runner, tensor/data parallel (held to SGLang 0.5.14, not run here)")
    engine_python: str | None = Field(default=None, description="vllm/sglang: the host Python with the engine")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vllm/sglang: GPUs per engine (8 for Kimi-K2.5 "
                                      "on 8xH200)")
    data_parallel_size: int = Field(default=1, ge=1, description="vllm/sglang: engines on the host, each "
                                    "tensor_parallel_size GPUs")
    extra_args: list[str] = Field(default=[], description="vllm: more server arguments (--gpu-memory-utilization ...)")
    env: dict[str, str] = Field(default={}, description="vllm: server environment (VLLM_* settings)")
    concurrency: int = Field(default=32, ge=1, description="vllm: samples in flight")
    ready_timeout_s: float = Field(default=1800, gt=0, description="vllm: how long the server may take to load the target")
    flush_timeout_s: float = Field(default=600, gt=0, description="vllm: how long the connector may take to write "
                                   "the shard's last part after the last request")
    max_model_len: int | None = Field(default=None, gt=0, description="vllm: the server's max_model_len (default: "
                                      "max_length)")
    aux_layers: list[int] | None = Field(
        default=None, min_length=3, max_length=3,
        description="3 decoder layer ids, 'output of layer i' convention (HF hidden_states[i+1]). "
                    "Empty: [1, N//2-1, N-4], which vLLM's and SGLang's defaults also capture; on a target of "
                    "3-6 layers, where those are not distinct, [0, N//2, N-1] (written into the vLLM export; SGLang "
                    "cannot read a last layer, so drafter_export leaves its dialect out, saying why)")
    max_length: int = Field(default=2048, gt=0, description="tokens per sample; longer samples are truncated")
    batch_tokens: int = Field(default=16384, gt=0, description="padded tokens per forward batch")
    part_bytes: int = Field(default=1 << 30, gt=0, description="target size of one safetensors part file")
    io_threads: int = Field(default=4, gt=0, description="threads writing and hashing parts")
    dtype: str = Field(default="auto", description=DTYPE_HELP)
    storage: Literal["native", "fp8"] = Field(default=DEFAULT_STORAGE, description="fp8: float8 e4m3 with one scale per token "
                                              "and layer (format v2, half of bf16 on disk; drafters trained on it "
                                              "measured within 1 % of bf16 shards' acceptance); native: hidden "
                                              "states in the compute dtype (format v1)")
    num_processes: int = Field(default=1, ge=1, description="hf: processes that split the shard's samples, one per "
                               "GPU of the host (torchrun; each writes its own parts of the one shard), or on a "
                               "CPU host a share of the cores each")
    seed: int = 0


class ExtractArgs(Args, ExtractSettings):
    target: str = Field(description="the target model directory")
    conversations: str = Field(description="the regenerated conversations' Parquet file")
    shard: int = Field(ge=0, description="which shard: conversations [shard*samples_per_shard, +samples_per_shard)")
    samples_per_shard: int = Field(gt=0)
    out_dir: str = Field(default="hidden_states", description="shards go to <out_dir>/shard-<shard:05d>")
    device: str = Field(default="auto", description="hf backend: auto, cpu, cuda, cuda:N")


CONTRACT = Contract(ExtractArgs)
