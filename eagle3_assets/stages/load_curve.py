"""Stage `load_curve`: one exported drafter's load curve on a real engine (throughput and time per output token at
a grid of concurrencies, for the target alone and each k up to the drafter's depth) and the speculation schedule
by load chosen from it (eagle3_assets/common/spec_schedule.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from ..common import spec_schedule
from .base import DEFAULT_ENGINE, NUM_SPECULATIVE_TOKENS, Args, Contract, EngineName, Result
from .serve_bench import ServeBenchSettings

GRID = [1, 2, 4, 8, 16, 32, 64]


class LoadCurveSettings(ServeBenchSettings):
    """serve_bench's launch settings; `concurrencies` is the grid, `num_speculative_tokens` the deepest k."""

    concurrencies: list[Annotated[int, Field(gt=0)]] = Field(
        default=GRID, min_length=1, description="the grid of requests in flight; 1 (one request alone) is always "
                                                "measured; points above max_concurrency are left out")
    max_concurrency: int = Field(default=64, gt=0, description="the grid's cap (and the engine's batch limit's, "
                                                               "when --max-num-seqs in extra_args is lower)")
    num_speculative_tokens: int = Field(default=NUM_SPECULATIVE_TOKENS, gt=0, description="the deepest k measured "
                                        "(every k from 1 up to it): the drafter's trained depth or less")
    max_new_tokens: int = Field(default=64, gt=0)
    rounds: int = Field(default=4, ge=1, description="paired rounds at each concurrency: in each, every server serves "
                        "one batch of that many requests, in turn; a k speculates there only where the rounds agree "
                        f"it wins (at least {spec_schedule.MIN_ROUNDS}, their lower quartile above "
                        f"1 + {spec_schedule.WIN_MARGIN:g} of the target alone's: common/spec_schedule.py)")
    tolerance: float = Field(default=0.03, ge=0, lt=0.5, description="a k is kept from the concurrency below "
                             "while within this share of the best (noise does not flip ranges)")


class LoadCurveArgs(Args, LoadCurveSettings):
    engine: EngineName = Field(default=DEFAULT_ENGINE)
    target: str = Field(description="the target model directory")
    drafter: str = Field(description="the exported drafter, in the engine's dialect")
    prompts: str = Field(description="prompts (Parquet), cycled to fill each concurrency")
    out_dir: str = Field(description="the curve, the schedule and the engines' launch files")

    @model_validator(mode="after")
    def _a_schedule_the_engine_follows(self):
        """A launch the engine would not follow a schedule with is refused before any server starts."""
        if why := spec_schedule.launch_refusals(list(self.extra_args or [])):
            raise ValueError("; ".join(why))
        return self


class LoadCurveResult(Result):
    schedule: list[list[int]]
    curve: dict
    vllm_speculative_config: str | None = None
    sglang_adaptive_config: str | None = None


CONTRACT = Contract(LoadCurveArgs, metadata=LoadCurveResult)
