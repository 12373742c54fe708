"""Stage `integration_data`: the integration gate's few samples (a shard of a handful of already-extracted
conversations and their prompts), and the parity of engine-extracted hidden states against transformers'."""

from __future__ import annotations

from pydantic import Field

from .base import Args, Contract, Result, Settings


class IntegrationDataSettings(Settings):
    samples: int = Field(default=4, gt=0, le=64, description="conversations the gate's drafter memorises and the "
                         "engine is then served (the first of the first shard that carry loss)")
    parity_samples: int = Field(default=2, ge=0, description="of those, how many the transformers reference "
                                "recomputes when the shards came from an engine backend (0: no parity check)")


class IntegrationDataArgs(Args, IntegrationDataSettings):
    target: str = Field(description="the target model directory")
    shards: list[str] = Field(min_length=1, description="hidden-state shard directories (samples: from the first)")
    conversations: str = Field(description="the regenerated conversations (Parquet), for the samples' prompts")
    out: str = Field(description="the gate's data directory: shard/ and prompts.parquet under it")
    dtype: str | None = Field(default=None, description="the reference's dtype (default: the shards')")
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N")


class IntegrationDataResult(Result):
    shard: str
    prompts: str
    samples: int
    parity: dict | None = None  # per layer: norm_ratio, cosine, passed; None: the shards came from hf


CONTRACT = Contract(IntegrationDataArgs, metadata=IntegrationDataResult)
