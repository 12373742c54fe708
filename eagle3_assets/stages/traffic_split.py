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
    weight_by: str | None = Field(default="kind", description="give the slices production served worst more of the "
                                  "training set: a group key (kind, length_bucket, first_words, or a gateway field the "
                                  "traffic config names in group_fields). The same number of training prompts, shared "
                                  "out by each slice's requests times its boost: the best slice's drafts accepted per "
                                  "step over this slice's, at most max_boost; a slice's prompts repeat when its share "
                                  "outgrows them. Needs served figures (a gateway log with vLLM's per-request metrics); "
                                  "without them, or with None, each prompt once (uniform). Default kind: on a day of chat and "
                                  "other languages it beat uniform on the worst-served slice at the same budget "
                                  "(bench/retrain_weighting.py, docs/benchmarks.md)")
    max_boost: float = Field(default=3.0, ge=1, description="weight_by: the most one slice is boosted")
    min_group: int = Field(default=8, gt=0, description="weight_by: requests with served figures a slice needs for "
                           "its acceptance to count (fewer: boost 1)")


class TrafficSplitArgs(Args, TrafficSplitSettings):
    days: list[str] = Field(min_length=1, description="the traffic partitions' Parquet files, newest first")
    out_dir: str = Field(description="train.parquet and heldout.parquet are written here")
    served_since: float | None = Field(default=None, description="weight_by: only requests logged at or after this "
                                       "time (epoch seconds) count toward a slice's served acceptance: the drafter "
                                       "retrained served them (retrain_data gives the production decision's time)")
    short_ok: bool = Field(default=False, description="under min_prompts: answer the counts ({short: true, why, "
                           "train_prompts, prompts_per_day}) and write nothing, instead of failing (retrain_data "
                           "polls with it while it waits for traffic)")


class TrafficSplitResult(Result):
    train: str
    heldout: str
    train_prompts: int
    heldout_prompts: int
    weighting: dict | None = None


CONTRACT = Contract(TrafficSplitArgs, metadata=TrafficSplitResult)
