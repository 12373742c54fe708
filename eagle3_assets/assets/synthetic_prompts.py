"""synthetic_prompts: prompts written by the target itself (stage `synthesize`), training data from the model
alone beside the human prompts; `conversations` regenerates replies to both, so the lineage of a result says
whether it rests on synthetic data and which settings made it."""

import dagster as dg

from ..code_versions import code_version
from ..hosts import GpuHost
from ..stages.synthesize import SynthesizeSettings
from .paths import HELD_OUT, SYNTHETIC, TRAIN
from .upstream import upstream_metadata


class SyntheticPromptsConfig(dg.Config, SynthesizeSettings):
    """The synthesize stage's settings (eagle3_assets/stages/synthesize.py)."""


@dg.asset(group_name="data", kinds={"pytorch", "parquet"}, deps=["target_model", "prompts"], pool="gpu_host",
          code_version=code_version(__name__, "synthetic_prompts"))
def synthetic_prompts(context: dg.AssetExecutionContext, config: SyntheticPromptsConfig,
                      gpu_host: GpuHost) -> dg.MaterializeResult:
    """`count` prompts the target wrote, each unlike every human prompt (training and held out) and every
    other synthetic one; none when count is 0. Resumable: a rerun with the same settings reuses what was
    generated."""
    target = upstream_metadata(context, "target_model")["path"]
    wrote = upstream_metadata(context, "prompts")  # HumanEval only when include_humaneval
    held_out = [p for p, key in zip(HELD_OUT, ("eval_path", "eval_humaneval_path")) if wrote.get(key)]
    run = gpu_host.run_stage(context, "synthesize", {"target": target, "train": TRAIN, "held_out": held_out,
                                                     "out": SYNTHETIC, **config.model_dump()})
    return run.materialize_result()
