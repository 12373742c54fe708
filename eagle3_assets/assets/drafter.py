from typing import Literal

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..hosts import GpuHost
from ..worker.files import PLAIN_NAME
from .hidden_states import OUT_DIR as SHARDS_DIR
from .partitions import shard_partitions
from .prompts import PROMPT_SETS
from .upstream import upstream_metadata
from .vocab import OUT as VOCAB

DRAFTER_DIR = "drafter"
EXPORT_DIR = "exports"


class DrafterConfig(dg.Config):
    # Pydantic checks these bounds as the step starts, before the asset runs anything: Dagster's config schema
    # (what the launchpad checks) carries types only.
    run_name: str = Field(default="default", pattern=PLAIN_NAME, description="output under drafter/<run_name>, a plain "
                          "name (letters, digits, -_.); a rerun with the same name, inputs and settings resumes")
    init_from: str | None = Field(default=None, description="an existing EAGLE-3 checkpoint directory on the host "
                                     "to finetune; its draft vocab and aux layers are reused")
    epochs: int = Field(default=3, gt=0)
    lr: float = Field(default=1e-4, gt=0)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    max_grad_norm: float = Field(default=0.5, gt=0)
    ttt_steps: int = Field(default=7, gt=0, description="training-time-test unroll length")
    row_tokens: int = Field(default=2048, gt=0, description="tokens per packed row")
    rows_per_batch: int = Field(default=4, gt=0)
    seed: int = 0
    loss_on: Literal["responses", "all"] = Field(default="all", description="tokens that carry loss: the "
                                                 "regenerated replies only, or every token (prompts too)")
    train_lm_head: bool = Field(default=True, description="train the draft lm_head (False: keep the target's rows)")
    init_head: Literal["target", "random"] = Field(default="target", description="start lm_head and final norm from "
                                                   "the target's rows and norm, or at random")
    aux_scale: Literal["none", "rms"] = Field(default="none", description="rms: train fc on aux hidden states "
                                              "scaled to unit size per layer (folded into fc on save)")
    noise_std: float = Field(default=0.0, ge=0, description="Gaussian noise on the aux hidden states while "
                             "training, relative to each layer's typical size (regularizes small data sets)")
    weight_decay: float = Field(default=0.0, ge=0)
    loss: Literal["soft", "hard"] = Field(default="soft", description="soft: cross-entropy against the target's "
                                          "distribution over the draft vocab; hard: against its greedy token")
    init_layer: int | None = Field(default=-1, description="start the (last) draft layer from this target decoder "
                                      "layer and earlier draft layers from the ones before it (-1: the last; "
                                      "measured +0.11 acceptance length held out); None: random")
    layer_lr: float = Field(default=1.0, ge=0, description="learning-rate multiplier for the draft decoder layers (fc, "
                            "the final norm and lm_head keep lr); measured +0.065 held-out acceptance length at 3.0")
    num_layers: int = Field(default=1, gt=0, description="draft decoder layers; more than 1 serves on vLLM only "
                            "(SGLang's later draft layers compute another function); measured +0.04 held-out "
                            "acceptance length at 2")
    precision: Literal["auto", "bf16", "fp32"] = Field(default="auto", description="auto: bf16 matmuls on GPUs and "
                                                      "on CPUs with bf16 instructions")
    time_budget_s: float | None = Field(default=None, gt=0, description="train for about this many seconds: "
                                           "the first steps are timed, then the run is cut to the steps that fit "
                                           "and the learning-rate schedule planned for them (None: all epochs)")
    save_every_steps: int = Field(default=0, ge=0, description="checkpoint every N steps (0: at each epoch end)")
    resume: bool = True
    num_processes: int = Field(default=1, gt=0, description="GPUs of the host to train on (data parallel, via "
                               "accelerate)")


def _shard_dirs(context: dg.AssetExecutionContext) -> list[str]:
    keys = context.instance.get_dynamic_partitions(shard_partitions.name)
    done = context.instance.get_materialized_partitions(dg.AssetKey("hidden_state_shards"))
    missing = [k for k in keys if k not in done]
    if not keys or missing:
        raise dg.Failure(description=f"hidden_state_shards partitions {missing or '(none registered)'} are not "
                                     "materialized: backfill hidden_state_shards first")
    return [f"{SHARDS_DIR}/shard-{k}" for k in keys]


@dg.asset(group_name="drafter", kinds={"pytorch"}, deps=["hidden_state_shards", "vocab_mapping", "target_model"],
          pool="gpu_host", code_version=code_version(__name__, "eagle3_drafter"))
def eagle3_drafter(context: dg.AssetExecutionContext, config: DrafterConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The trained EAGLE-3 draft head (canonical checkpoint under drafter/<run_name>/model). Data version =
    hash of the saved weights: every export and benchmark downstream names the exact checkpoint."""
    target = upstream_metadata(context, "target_model")["path"]
    args = {"target": target, "shards": _shard_dirs(context), "vocab": VOCAB,
            "out": f"{DRAFTER_DIR}/{config.run_name}", **config.model_dump()}  # the worker checks run_name too
    return gpu_host.run_stage(context, "train", args).materialize_result()


class ExportConfig(dg.Config):
    dialects: list[str] = Field(default=["vllm", "sglang"])


@dg.asset(group_name="drafter", kinds={"safetensors"}, deps=["eagle3_drafter", "target_model"],
          code_version=code_version(__name__, "drafter_export"))
def drafter_export(context: dg.AssetExecutionContext, config: ExportConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The drafter as vLLM and SGLang load it (exports/<version>/{vllm,sglang}), each validated against its
    contract: names, shapes, dtypes, config fields, and which target layers the engine will capture."""
    drafter = upstream_metadata(context, "eagle3_drafter")
    target = upstream_metadata(context, "target_model")["path"]
    version = context.instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter")).asset_materialization.tags.get(
        "dagster/data_version", "latest")
    run = gpu_host.run_stage(context, "export", {"drafter": drafter["path"], "target": target,
                                                 "out": f"{EXPORT_DIR}/{version[:12]}", "dialects": config.dialects})
    return run.materialize_result()


class OfflineAcceptanceConfig(dg.Config):
    eval_set: str = Field(default="eval", description="eval (held-out split) or humaneval")
    num_speculative_tokens: int = Field(default=3, gt=0)
    max_new_tokens: int = Field(default=64, gt=0)
    limit: int | None = Field(default=16, gt=0, description="prompts evaluated (None: all)")
    dtype: str | None = Field(default=None, description="default: float32 on CPU (exact), bfloat16 on GPU")


@dg.asset(group_name="drafter", kinds={"pytorch"}, deps=["eagle3_drafter", "prompts", "target_model"],
          pool="gpu_host", code_version=code_version(__name__, "offline_acceptance"))
def offline_acceptance(context: dg.AssetExecutionContext, config: OfflineAcceptanceConfig,
                       gpu_host: GpuHost) -> dg.MaterializeResult:
    """Our own greedy chain speculative decoding on held-out prompts: acceptance length, per-position
    acceptance, and whether the output equals the target's greedy output. The reference for engine numbers."""
    if config.eval_set not in PROMPT_SETS:
        raise dg.Failure(description=f"eval_set must be one of {sorted(PROMPT_SETS)}, got {config.eval_set!r}")
    drafter = upstream_metadata(context, "eagle3_drafter")
    target = upstream_metadata(context, "target_model")["path"]
    run = gpu_host.run_stage(context, "speculate", {
        "target": target, "drafter": drafter["path"], "prompts": PROMPT_SETS[config.eval_set], "limit": config.limit,
        "num_speculative_tokens": config.num_speculative_tokens, "max_new_tokens": config.max_new_tokens,
        "dtype": config.dtype})
    return run.materialize_result()
