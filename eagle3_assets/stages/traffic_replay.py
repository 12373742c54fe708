"""Stage `traffic_replay`: the drafter's acceptance on a day of served prompts (the `traffic` partition), by our own
replay speculation on the target, per prompt and per group of prompts (kind, length, first words), beside its
acceptance on the eval set it was measured on when trained: the offline drift signal, and where it is."""

from __future__ import annotations

from pydantic import Field

from .base import EVAL_NEW_TOKENS, NUM_SPECULATIVE_TOKENS, Args, Contract, Result, Settings


class TrafficReplaySettings(Settings):
    limit: int = Field(default=48, gt=0, description="traffic prompts replayed: the first of the day's seeded sample")
    eval_limit: int = Field(default=16, gt=0, description="eval prompts replayed, when the eval figure is not taken "
                            "from offline_acceptance (as offline_acceptance's limit)")
    num_speculative_tokens: int = Field(default=NUM_SPECULATIVE_TOKENS, gt=0)
    max_new_tokens: int = Field(default=EVAL_NEW_TOKENS, gt=0)
    dtype: str | None = Field(default=None, description="default: float32 on CPU (exact), bfloat16 on GPU")
    batch_size: int = Field(default=8, gt=0, description="prompts whose greedy outputs are generated at once")
    min_group: int = Field(default=3, gt=0, description="a group of prompts is reported with at least this many")
    lowest: int = Field(default=10, ge=0, description="the prompts of lowest acceptance listed (redacted text)")
    budget_s: float | None = Field(default=600.0, gt=0, description="the replay stops taking more traffic prompts "
                                   "past this many seconds (the eval prompts first, then the traffic a batch at a "
                                   "time) and reports on those replayed; None: all `limit` of them")
    nice: int = Field(default=10, ge=0, le=19, description="the replay's CPU priority on the host (added niceness): "
                      "a production server on the same machine keeps serving beside it")


class TrafficReplayArgs(Args, TrafficReplaySettings):
    target: str = Field(description="the target model directory")
    drafter: str = Field(description="the drafter: a trained checkpoint or an engine export directory")
    traffic: str = Field(description="the day's traffic sample (Parquet, the traffic asset's partition)")
    eval_prompts: str | None = Field(default=None, description="the eval set, replayed for the reference figure; "
                                     "None: the caller has it (offline_acceptance of the same checkpoint)")
    training: list[str] = Field(default=[], description="what the drafter was trained on (Parquet with messages): "
                                "each group's share of it, and each lowest prompt's nearest training prompt")
    out: str = Field(description="per-prompt results (Parquet)")
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N")


class TrafficReplayResult(Result):
    acceptance_length: float
    prompts: int
    groups: list[dict]


CONTRACT = Contract(TrafficReplayArgs, metadata=TrafficReplayResult)
