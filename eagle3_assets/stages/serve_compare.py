"""Stage `serve_compare`: several exported drafters served by one engine with the same settings, one after another
in the same run, each on the same prompt sets, against the same server without speculation: the promotion gate's
measurement (champion and challenger, on held-out recent traffic and on the standing eval set)."""

from __future__ import annotations

from pydantic import Field, field_validator

from ..common import load_mix
from .base import DEFAULT_ENGINE, EVAL_NEW_TOKENS, NUM_SPECULATIVE_TOKENS, Args, Contract, EngineName, Result
from .serve_bench import ServeBenchSettings


class ServeCompareSettings(ServeBenchSettings):
    """serve_bench's launch settings; measured at the first of `concurrencies` (one request at a time by default)
    and, on the first prompt set, at each concurrency of `load_mix`."""

    concurrencies: list[int] = Field(default=[1], min_length=1, description="the first is measured")
    load_mix: dict[str, float] | None = Field(
        default=None, description="{concurrency: share of the output made at it}: the first prompt set is also "
        "measured at each concurrency, and the speedup is the mix's (the target alone's time to make that output over "
        "the drafter's); None: the first concurrency alone")

    @field_validator("load_mix")
    @classmethod
    def _a_mix_of_concurrencies(cls, v):
        return None if v is None else {str(c): s for c, s in load_mix.check(v).items()}
    limit: int | None = Field(default=16, gt=0, description="prompts per set (None: all)")
    max_new_tokens: int = Field(default=EVAL_NEW_TOKENS, gt=0)
    num_speculative_tokens: int = Field(default=NUM_SPECULATIVE_TOKENS, gt=0)


class ServeCompareArgs(Args, ServeCompareSettings):
    engine: EngineName = Field(default=DEFAULT_ENGINE)
    target: str = Field(description="the target model directory")
    drafters: dict[str, str] = Field(min_length=1, description="label -> exported drafter (the engine's dialect)")
    prompt_sets: dict[str, str] = Field(min_length=1, description="name -> prompts (Parquet)")
    out_dir: str = Field(description="the servers' logs and the requests' outputs")
    schedule_of: str | None = Field(default=None, description="a drafter's label: its speculation schedule by load is "
                                    "also chosen from these batches (the first set's tokens/s at each concurrency "
                                    "measured, against the target alone's) and written into schedule_dir")
    schedule_dir: str | None = Field(default=None, description="where that schedule's files go (the load_curve "
                                     "stage's: the launch files and load_curve.json)")


class ServeCompareResult(Result):
    figures: dict


CONTRACT = Contract(ServeCompareArgs, metadata=ServeCompareResult)
