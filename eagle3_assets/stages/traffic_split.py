"""Stage `traffic_split`: the newest days of served prompts (the `traffic` partitions) cut into what a retraining
trains on and what the promotion gate measures on, by a stable hash of each prompt: no prompt is in both."""

from __future__ import annotations

from pydantic import Field

from .base import Args, Contract, Result, Settings


class TrafficSplitSettings(Settings):
    heldout_share: float = Field(default=0.2, gt=0, lt=1, description="share of the traffic held out for the "
                                 "promotion gate (by a hash of the prompt: the same prompt always falls the same way)")
    min_prompts: int = Field(default=32, gt=0, description="fewer training prompts than this in the days taken: "
                             "nothing is retrained (too little new traffic to learn from)")
    max_prompts: int | None = Field(default=None, gt=0, description="at most this many training prompts (the newest "
                                    "days first)")


class TrafficSplitArgs(Args, TrafficSplitSettings):
    days: list[str] = Field(min_length=1, description="the traffic partitions' Parquet files, newest first")
    out_dir: str = Field(description="train.parquet and heldout.parquet are written here")
    short_ok: bool = Field(default=False, description="under min_prompts: answer the counts ({short: true, why, "
                           "train_prompts, prompts_per_day}) and write nothing, instead of failing (retrain_data "
                           "polls with it while it waits for traffic)")


class TrafficSplitResult(Result):
    train: str
    heldout: str
    train_prompts: int
    heldout_prompts: int


CONTRACT = Contract(TrafficSplitArgs, metadata=TrafficSplitResult)
