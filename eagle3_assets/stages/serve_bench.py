"""Stage `serve_bench`: the exported drafter served by a real engine, against the same server without it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from ..common import spec_schedule
from .base import (
    DEFAULT_ENGINE,
    DTYPE_HELP,
    EVAL_NEW_TOKENS,
    NUM_SPECULATIVE_TOKENS,
    Args,
    Contract,
    EngineLaunch,
    EngineName,
    Result,
)


class ServeBenchSettings(EngineLaunch):
    limit: int | None = Field(default=16, gt=0, description="prompts sent (None: all), as offline_acceptance's limit")
    max_new_tokens: int = Field(default=EVAL_NEW_TOKENS, gt=0, description="per request, as offline_acceptance's")
    num_speculative_tokens: int = Field(default=NUM_SPECULATIVE_TOKENS, gt=0)
    concurrencies: list[Annotated[int, Field(gt=0)]] = Field(default=[1, 8], min_length=1,
                                                             description="requests in flight, one measurement each")
    dtype: str = Field(default="auto", description=DTYPE_HELP)
    max_model_len: int = Field(default=4096, gt=0)
    engine_python: str | None = Field(default=None, description="the host Python with the engine installed "
                                                                    "(default: the worker's)")
    extra_args: list[str] = Field(default=[], description="more server arguments, passed through as given")
    env: dict[str, str] = Field(default={}, description="server environment (VLLM_CPU_KVCACHE_SPACE, ...)")
    ready_timeout_s: float = Field(default=1200.0, gt=0, description="fail if the server is not healthy by then")
    baseline: bool = Field(default=True, description="also measure the same server without speculation (speedup)")
    rounds: int = Field(default=4, ge=1, description="paired rounds at each concurrency, at least: the prompts are "
                        "served in batches of that many requests, the drafter's server and the baseline in turn; "
                        "the speedup is the median of the batches' ratios, their quartiles its spread")
    start_servers: Literal["auto", "together", "one_at_a_time"] = Field(
        default="auto", description="together: every server the benchmark needs starts at once, then each is "
                                    "measured while the others idle (on a CPU a start is mostly imports, a core "
                                    "each); auto: together on a host without GPUs whose free memory holds them all")
    seed: int = 0


class SweepChoice(BaseModel):
    """What the sweep chose, for the benchmark to verify (speculation_schedule's metadata)."""
    table: list[dict] = Field(description="its rows: concurrency, the k chosen there, speedup (the k's median ratio)")
    max_batch: int = Field(gt=0, description="the schedule's last batch size")
    tolerance: float = Field(ge=0, lt=0.5, description="how far (a share) the verification may measure below it")


class ServeBenchArgs(Args, ServeBenchSettings):
    engine: EngineName = Field(default=DEFAULT_ENGINE, description="the serving engine (serving_benchmark: its partition)")
    target: str = Field(description="the target model directory")
    drafter: str = Field(description="the exported drafter, in the engine's dialect")
    trained_drafter: str | None = Field(default=None, description="the canonical checkpoint it was exported from "
                                        "(to compare the aux layers it was trained on with those served)")
    prompts: str = Field(description="eval prompts (Parquet)")
    prompt_set: str | None = Field(default=None, description="the eval set's name, for the history")
    checkpoint: str | None = Field(default=None, description="the drafter's data version, for the history")
    history: str = Field(description="the Parquet history a row per measurement is appended to")
    out_dir: str = Field(description="this benchmark's reports")
    schedule: list[list[int]] | None = Field(default=None, description="serve the drafter with this speculation "
                                             "schedule ([first, last, k] batch-size ranges, speculation_schedule's) "
                                             "instead of a fixed num_speculative_tokens")

    verify: SweepChoice | None = Field(default=None, description="with a schedule: the sweep's choice, verified "
                                       "concurrency by concurrency (spec_schedule.verify); where the schedule falls "
                                       "back to off, its launch files beside the drafter are rewritten")

    @field_validator("schedule")
    @classmethod
    def _a_schedule_an_engine_takes(cls, v):
        """Refused here, before any server starts, naming the range."""
        return None if v is None else [list(r) for r in spec_schedule.check(v)]


class ServeBenchResult(Result):
    engine: str
    acceptance_length: float | None = None
    acceptance_per_pos: list[float] | None = None
    num_speculative_tokens: int
    acceptance_k: int | None = None  # the k acceptance_length was counted at (a schedule's at that load; None: mixed)
    speedup: float | None = None
    checkpoint: str | None = None
    served_aux_layers: list[int] | None = None
    trained_aux_layers: list[int] | None = None
    verified_schedule: list[list[int]] | None = None  # the schedule after its verification, where it fell back


CONTRACT = Contract(ServeBenchArgs, metadata=ServeBenchResult)
