"""Stage `traffic_sample`: one day of served prompts, already redacted by the control plane, cut to a sample free of
near duplicates, of each other and of every held-out prompt set."""

from __future__ import annotations

from pydantic import Field

from .base import Args, Contract, Result, Settings


class TrafficSampleSettings(Settings):
    max_prompts: int = Field(default=1000, gt=0, description="the day's sample: at most this many prompts")
    dedup_threshold: float = Field(default=0.7, gt=0, le=1, description="Jaccard similarity of character 5-gram "
                                   "shingles (MinHash LSH, as synthetic_prompts) at which a prompt is a near duplicate "
                                   "of a held-out prompt or of one kept before it, and is dropped")
    min_group: int = Field(default=3, gt=0, description="a group of requests is reported with its served acceptance "
                           "with at least this many requests that carry served figures")


class TrafficSampleArgs(Args, TrafficSampleSettings):
    candidates: str = Field(description="the day's redacted candidates (Parquet, the prompts schema plus rank and "
                            "timestamp), in the seeded order the sample keeps them; removed once the sample is written")
    held_out: list[str] = Field(default=[], description="every held-out prompt set (Parquet): near copies dropped")
    out: str = Field(description="the day's sample (Parquet)")
    group_fields: list[str] = Field(default=[], description="the gateway fields (in gateway_fields) to group by too")


class TrafficSampleResult(Result):
    path: str
    prompts: int
    requests_served: int = 0


CONTRACT = Contract(TrafficSampleArgs, metadata=TrafficSampleResult)
