"""Stage `generate`: the target regenerates every assistant turn of the training prompts, greedy and sampled."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import DTYPE_HELP, NAMES, Args, Contract, EngineLaunch, Result


class GenerateSettings(EngineLaunch):
    backend: Literal[("hf", *NAMES)] = Field(
        default="hf", description="hf: batched generate in the worker; vllm / sglang: the target served on the host "
                                  "(same launch as serving_benchmark), batch_size requests in flight")
    engine_python: str | None = Field(default=None, description="server backends: the host Python with the engine")
    extra_args: list[str] = Field(default=[], description="server backends: more server arguments")
    env: dict[str, str] = Field(default={}, description="server backends: server environment")
    ready_timeout_s: float = Field(default=1200, gt=0, description="server backends: how long the server may take "
                                   "to load the target")
    max_new_tokens: int = Field(default=256, gt=0, description="per assistant turn")
    temperature: float = Field(default=0.0, ge=0, description="the first reply to each prompt: 0 = greedy, "
                               "matching greedy serving and offline acceptance")
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = 0
    responses_per_prompt: int = Field(default=1, ge=1, le=64, description="replies per training prompt, each its own "
                                      "conversation: the first as above, the others sampled (sample_temperature, "
                                      "sample_top_p, sample_seed)")
    sample_temperature: float = Field(default=0.8, gt=0, description="the extra replies' sampling temperature")
    sample_top_p: float = Field(default=0.95, gt=0, le=1)
    sample_seed: int = 1
    max_bad_reply_share: float = Field(default=0.5, ge=0, le=1, description="fail the stage when more than this share "
                                       "of the replies are empty or loop (the same few tokens over and over)")
    batch_size: int = Field(default=32, gt=0, description="conversations generated together")
    max_prompt_tokens: int = Field(default=2048, gt=0, description="a conversation whose history grows past this "
                                   "ends there")
    limit: int | None = Field(default=None, gt=0, description="regenerate only the first N training conversations")
    time_budget_s: float | None = Field(default=None, gt=0, description="seconds of generation (a server's start "
                                        "not counted): a batch or request that would end past them, by the time the "
                                        "ones before took, is not started, and the conversations it would have begun "
                                        "are left out (counted in the metadata). Sizes the data to the machine: a "
                                        "slower one regenerates fewer prompts in the same time")
    dtype: str = Field(default="auto", description=DTYPE_HELP)


class GenerateArgs(Args, GenerateSettings):
    target: str = Field(description="the target model directory")
    prompts: str = Field(description="training prompts (Parquet, the prompts asset's schema)")
    extra_prompts: list[str] = Field(default=[], description="more prompts after them (the synthetic prompts), in the "
                                     "same schema; `limit` counts the training prompts only")
    out: str = Field(description="the regenerated conversations' Parquet file")
    device: str = Field(default="auto", description="hf backend: auto, cpu, cuda, cuda:N")


class GenerateResult(Result):
    conversations: int


CONTRACT = Contract(GenerateArgs, result=GenerateResult)
