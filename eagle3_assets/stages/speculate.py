"""Stage `speculate`: our own greedy chain speculative decoding, the offline acceptance reference."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import EVAL_NEW_TOKENS, NUM_SPECULATIVE_TOKENS, Args, Contract, Result, Settings


class SpeculateSettings(Settings):
    num_speculative_tokens: int = Field(default=NUM_SPECULATIVE_TOKENS, gt=0, description="draft length k; replay "
                                        "also measures every shorter one (acceptance_length_k1 ... _k{k}), the "
                                        "figures an engine serving a lower k (a schedule's) is held against")
    max_new_tokens: int = Field(default=EVAL_NEW_TOKENS, gt=0)
    limit: int | None = Field(default=16, gt=0, description="prompts evaluated (None: all)")
    dtype: str | None = Field(default=None, description="default: float32 on CPU (exact), bfloat16 on GPU")
    method: Literal["replay", "decode"] = Field(default="replay", description="replay: the target's greedy "
                                                "outputs generated in batches, each verify step replayed on its "
                                                "hidden states (the same figures, 4-8x fewer target forwards); "
                                                "decode: the draft-verify loop itself, one prompt at a time, at "
                                                "num_speculative_tokens alone")
    batch_size: int = Field(default=8, gt=0, description="replay: prompts generated at once")


class SpeculateArgs(Args, SpeculateSettings):
    target: str = Field(description="the target model directory")
    drafter: str = Field(description="the trained drafter's model directory")
    prompts: str = Field(description="eval prompts (Parquet)")
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N")


class SpeculateResult(Result):
    acceptance_length: float


CONTRACT = Contract(SpeculateArgs, metadata=SpeculateResult)
