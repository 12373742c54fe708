"""Stage `train`: the EAGLE-3 drafter, trained with training-time test on the hidden-state shards."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..common.shard_format import HIDDEN_STATES
from .base import DTYPE_HELP, Args, Contract, Result, Settings, plain_name

# The settings that decide the trained weights: they go into the checkpoint's fingerprint (a resume with any
# of them changed starts afresh) and into the drafter's metadata.
HYPERPARAMETERS = ("epochs", "lr", "warmup_ratio", "max_grad_norm", "ttt_steps", "row_tokens", "rows_per_batch",
                   "seed", "step_decay", "loss_on", "train_lm_head", "init_head", "precision", "aux_scale",
                   "noise_std", "weight_decay", "init_layer", "loss", "layer_lr", "num_layers", "time_budget_s",
                   "mix_share")


class TrainSettings(Settings):
    run_name: str = Field(default="default", description="output under drafter/<run_name>, a plain "
                          "name (letters, digits, -_.); a rerun with the same name, inputs and settings resumes")
    init_from: str | None = Field(default=None, description="an existing EAGLE-3 checkpoint directory on the host "
                                     "to finetune, or shipped:<name>, a base drafter the package ships (the "
                                     "embedded target's: shipped:smollm2-135m-instruct); its draft vocab and aux "
                                     "layers are reused")
    epochs: int = Field(default=3, gt=0)
    lr: float = Field(default=1e-4, gt=0)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    max_grad_norm: float = Field(default=0.5, gt=0)
    ttt_steps: int = Field(default=7, gt=0, description="training-time-test unroll length")
    step_decay: float = Field(default=0.8, gt=0, le=1, description="loss weight of unroll step i: step_decay^i")
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
    mix_share: float = Field(default=0.0, ge=0, lt=1, description="with mix_shards (the data a finetuned drafter "
                             "was trained on): the share of the training samples drawn from them, a seeded sample, "
                             "so that the finetune does not forget what it served before")
    hidden_states: Literal[HIDDEN_STATES] = Field(
        default="offline", description="offline: from the hidden-state shards; online: from the target itself, "
        "loaded beside the drafter (hf backend), batch by batch, nothing written to disk (from the conversations); "
        "auto: offline when shards are on disk or would fit the free disk with a 20 % margin, else online")
    online_from: Literal["target", "vllm"] = Field(
        default="target", description="online: where the hidden states come from: target (loaded beside the "
        "drafter, the hf backend) or vllm (the product's vLLM extraction streams them into the trainer over a local "
        "socket, one batch ahead: for a target no training GPU holds; launch settings in online_engine)")
    online_engine: dict = Field(default={}, description="online_from vllm: the engine's launch settings, as "
                                "hidden_state_shards takes them (engine_python, tensor_parallel_size, env, "
                                "extra_args, dtype, ready_timeout_s, concurrency, ...)")
    save_every_steps: int = Field(default=0, ge=0, description="checkpoint every N steps (0: at each epoch end)")
    resume: bool = True
    num_processes: int = Field(default=1, gt=0, description="GPUs of the host to train on (data parallel, via "
                               "accelerate)")
    tracker: Literal["none", "tensorboard"] = Field(default="none", description="tensorboard: also write the "
                                                    "training curves as TensorBoard events under <out>/tensorboard")


    _plain_run_name = field_validator("run_name")(classmethod(lambda cls, v: plain_name(v)))

    @field_validator("online_engine")
    @classmethod
    def _engine_settings(cls, v: dict) -> dict:
        from .extract import ExtractSettings

        ExtractSettings(**v)  # a misspelt or ill-typed setting fails here, naming it, not on the host
        return v


class TrainArgs(Args, TrainSettings):
    target: str = Field(description="the target model directory")
    shards: list[str] = Field(default=[], description="hidden-state shard directories (hidden_states offline)")
    conversations: str | None = Field(default=None, description="online: the regenerated conversations' Parquet "
                                      "file (what the extraction reads), every sample of it")
    max_length: int = Field(default=2048, gt=0, description="online: tokens per sample, longer samples truncated "
                            "(as the extraction's max_length)")
    aux_layers: list[int] | None = Field(default=None, min_length=3, max_length=3, description="online: the 3 "
                                         "aux layer ids (output-of-layer convention); None: a finetune's own, else "
                                         "the extraction's default")
    dtype: str = Field(default="auto", description="online: the target's compute dtype; " + DTYPE_HELP)
    target_batch_tokens: int = Field(default=4096, gt=0, description="online: padded tokens per target forward "
                                     "(the extraction's batch_tokens; smaller here: a batch's few samples pad less)")
    vocab: str | None = Field(default=None, description="the draft vocab (d2t/t2d safetensors); None: the "
                              "finetuned checkpoint's, or the full target vocab")
    out: str = Field(description="the run's directory (model/ and checkpoints/ under it)")
    eval_shards: list[str] = Field(default=[], description="held-out shards for the per-epoch evaluation")
    mix_shards: list[str] = Field(default=[], description="older shards mixed in at mix_share (a retraining's old data)")
    probe_batches: int = Field(default=8, ge=0, description="batches timed before training to report the pace")
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N")

    @model_validator(mode="after")
    def _inputs(self):
        if self.hidden_states == "offline" and not self.shards:
            raise ValueError("shards: required for hidden_states offline (or set hidden_states online with "
                             "conversations)")
        if self.hidden_states == "online" and not self.conversations:
            raise ValueError("conversations: required for hidden_states online (the Parquet file the target's "
                             "hidden states are computed from)")
        if self.hidden_states == "auto" and not (self.shards or self.conversations):
            raise ValueError("shards or conversations: required for hidden_states auto")
        if self.online_from == "vllm" and self.num_processes > 1:
            raise ValueError("online_from vllm trains in one process (the engine streams to one trainer): set "
                             "num_processes 1, or train offline from shards")
        return self

    @field_validator("out")
    @classmethod
    def _no_climbing(cls, v: str) -> str:
        if ".." in v.replace("\\", "/").split("/"):
            raise ValueError(f"{v!r} contains '..': the drafter's directory must not climb out of the place it names "
                             "(a run_name is a plain name under drafter/)")
        return v


class TrainResult(Result):
    path: str


CONTRACT = Contract(TrainArgs, metadata=TrainResult)
