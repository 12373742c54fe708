"""Stage `vocab`: the draft vocabulary from the regenerated conversations' assistant tokens."""

from __future__ import annotations

from pydantic import Field

from .base import Args, Contract, Settings


class VocabSettings(Settings):
    draft_vocab_size: int = Field(default=32000, gt=0, description="capped at the target's vocab size")


class VocabArgs(Args, VocabSettings):
    target: str = Field(description="the target model directory")
    conversations: str = Field(description="the regenerated conversations' Parquet file")
    out: str = Field(description="the d2t/t2d safetensors file")


CONTRACT = Contract(VocabArgs)
