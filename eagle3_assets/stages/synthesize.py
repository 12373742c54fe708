"""Stage `synthesize`: prompts written by the target itself, filtered and deduplicated against every human one."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import DTYPE_HELP, NAMES, Args, Contract, EngineLaunch, Result


class SynthesizeSettings(EngineLaunch):
    count: int | None = Field(default=None, ge=0, description="synthetic prompts to write (0: none, the conversations "
                              "are the human prompts' alone; None: per_training_prompt x the human training prompts)")
    per_training_prompt: float = Field(default=7.0, ge=0, description="with count None: synthetic prompts per human "
                                       "training prompt. Measured on the embedded target (bench/drafter_recipe.py, "
                                       "data_s4 / data_s8): 3 and 7 per prompt raised the acceptance length on held-"
                                       "out prompts in vLLM from 1.59 to 1.77 and 1.89")
    method: Literal["magpie", "seeded", "mixed"] = Field(
        default="mixed", description="magpie: the chat template up to the user's turn, the target writes the user's "
                                     "words; seeded: the same with the turn begun by the first words of a human "
                                     "training prompt (its topics and kinds); mixed: alternately")
    seed_words: int = Field(default=3, ge=1, le=16, description="seeded: words of the human prompt that begin the turn "
                            "(at most half of its words)")
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=0.95, gt=0, le=1)
    seed: int = 0
    max_new_tokens: int = Field(default=96, gt=0, description="a prompt longer than this is dropped as unfinished")
    min_words: int = Field(default=4, ge=1, description="shorter prompts are dropped")
    max_words: int = Field(default=200, gt=0, description="longer prompts are dropped")
    dedup_threshold: float = Field(default=0.7, gt=0, le=1, description="estimated Jaccard similarity of character "
                                   "5-gram shingles (MinHash LSH) at which a prompt counts as a near duplicate of a human "
                                   "prompt (training or held out) or of an earlier synthetic one, and is dropped")
    max_candidates_per_prompt: float = Field(default=4.0, ge=1, description="give up (and fail) after count x this "
                                             "many candidates")
    chunk_size: int = Field(default=256, gt=0, description="candidates generated, and kept on disk, at a time: a "
                            "rerun with the same settings reuses the chunks written and writes the same set")
    backend: Literal[("hf", *NAMES)] = Field(default="hf", description="hf: batched generate in the worker; vllm / "
                                             "sglang: the target served on the host")
    batch_size: int = Field(default=64, gt=0)
    engine_python: str | None = Field(default=None, description="server backends: the host Python with the engine")
    extra_args: list[str] = Field(default=[], description="server backends: more server arguments")
    env: dict[str, str] = Field(default={}, description="server backends: server environment")
    ready_timeout_s: float = Field(default=1200, gt=0)
    dtype: str = Field(default="auto", description=DTYPE_HELP)


class SynthesizeArgs(Args, SynthesizeSettings):
    target: str = Field(description="the target model directory")
    train: str = Field(description="the human training prompts (Parquet): seeds, and near duplicates to avoid")
    held_out: list[str] = Field(default=[], description="every held-out prompt set (Parquet): near duplicates dropped")
    out: str = Field(description="the synthetic prompts' Parquet file (the prompts asset's schema)")
    device: str = Field(default="auto", description="hf backend: auto, cpu, cuda, cuda:N")


class SynthesizeResult(Result):
    path: str
    prompts: int


CONTRACT = Contract(SynthesizeArgs, metadata=SynthesizeResult)
