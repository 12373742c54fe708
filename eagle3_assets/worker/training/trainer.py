"""Stage `train`: the EAGLE-3 drafter, trained with training-time test (TTT).

For every position t the draft sees the next token x[t+1] and the target's aux hidden states at t, and
predicts the target's distribution at t+1; then it unrolls k-1 more steps on its own output hidden states
(tokens shifted by one each step), as it will at inference. Loss: soft-label cross-entropy against the
target's softmax restricted to the draft vocab (computed from the stored final hidden state through the
target's norm and lm_head), step weights 0.8^i; positions whose target argmax is outside the draft vocab
are masked out of the loss and count as misses in the accuracy.

Resumable: checkpoints hold weights, optimizer, scheduler, step, epoch and the RNG state; the data order is
a function of (seed, epoch), so a resumed run ends with the same weights as an uninterrupted one. A checkpoint
resumes only the run it belongs to: its fingerprint covers the content of every input (each shard's file and
index hashes and aux layers, the vocab, the target's weights, a finetune's start), the hyperparameters and
the training code; any difference is logged and the run starts afresh, its old checkpoints deleted.

On a GPU (`gpu_path`): flex chain attention and compiled layer pieces, batches made ahead by a thread
(prefetch.py) in fixed shapes, no host sync per step, checkpoints written by a thread (checkpoint_writer.py).

The stage is a `Trainer` in steps: `setup` (inputs checked, the model built and initialised, labels, the
batch plan, the optimizer), `resume`, `fit` (epochs of `train_step`s, with `evaluate_heldout` and
`checkpoint` at their ends), then `publish` (the final weights, only if every step was finite).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import time
from typing import TYPE_CHECKING

import torch

from ...common import charts
from ...common.sizes import size_text
from ...stages.train import HYPERPARAMETERS
from ..compute_dtype import cpu as cpu_info
from ..errors import StageError
from ..files import resolve
from ..target.head import load_target_head
from ..target.model import load_config, text_config
from .checkpoint_writer import CheckpointWriter
from .data import ShardSet, batch_tokens, on_device, plan_batches
from .drafter import DraftConfig, Eagle3Drafter, init_weights
from .evaluate import autocast, bf16_compute, evaluate, host_batch, simulated_acceptance_length, target_labels
from .prefetch import Prefetcher
from .resume import fingerprint, resumable_state
from .schedule import CALIBRATION_STEPS, lr_lambda, plan_budget, recheck_budget, replan
from .tracker import open_tracker
from .ttt_loss import compile_on, draft_index, gpu_path, ttt_loss

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.train import TrainArgs

PACK_WINDOW = 8  # GPU path: open rows a sample may go into (first fit), for fuller fixed-shape rows
FINITE_CHECK_EVERY = 50  # GPU path: steps between reads of the non-finite-loss flag (each read is a host sync)


def aux_rms_scale(data: ShardSet, hidden: int, samples: int = 64) -> torch.Tensor:
    """1 / (median per-token RMS) of each aux layer over a fixed sample of the data, per channel."""
    step = max(1, len(data.refs) // samples)
    refs = data.refs[::step]
    reads = data.read_many(refs) if hasattr(data, "read_many") else (data.read(r) for r in refs)  # engine: one pass
    aux = torch.cat([r["aux"].float() for r in reads])
    rms = aux.view(aux.shape[0], 3, hidden).pow(2).mean(-1).sqrt().median(0).values.clamp(min=1e-6)
    return (1.0 / rms).repeat_interleave(hidden)


def _sync(device: str) -> None:
    """Wait for the GPU's queued work: only where a wall-clock reading must include it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)




class Trainer:
    """One training run of the `train` stage (args validated against stages.train.TrainArgs)."""

    def __init__(self, workdir: str, args: TrainArgs, reporter):
        from .distributed import Group

        self.workdir, self.args, self.reporter = workdir, args, reporter
        self.hp = args  # num_layers may be replaced by a finetune's own (a copy, below)
        self.loader: dict = {}  # the GPU loader's figures, set by fit
        self.out = resolve(workdir, args.out)
        self.target = resolve(workdir, args.target)
        self.tc = text_config(load_config(self.target))
        device = args.device
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.group = Group(device)
        self.device = self.group.device
        self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        self.bf16 = bf16_compute(self.device, str(self.hp.precision))
        self.fast = gpu_path(self.device)
        self.ckpts = self.out / "checkpoints"
        self.writer = CheckpointWriter()

    # ---- setup ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        hp, device, reporter = self.hp, self.device, self.reporter
        if self.group.is_main:
            where = "" if device.startswith("cuda") else f" on {cpu_info()['cpu']} ({', '.join(cpu_info()['cpu_isa'])})"
            reporter.log(f"training in {'bf16 autocast (fp32 master weights)' if self.bf16 else 'float32'} "
                         f"(precision {hp.precision}){where}")
        torch.manual_seed(int(hp.seed))
        if device == "cpu":
            torch.use_deterministic_algorithms(True)
        self.head = load_target_head(self.target, self.tc.rms_norm_eps)
        self._load_inputs()
        if self.group.is_main and self.mode == "offline":
            reporter.log(f"hidden-state shards checked: {self.data.verified_bytes / 1e6:,.1f} MB, every file's sha256 "
                         "as its manifest records, hidden states finite")
        self._build_model()
        self._make_labels_and_plans()
        self._make_optimizer()

    def _load_inputs(self) -> None:
        """The shards and the draft vocab, or a finetune's checkpoint (its vocab and aux layers reused)."""
        from .base_drafters import init_dir
        from .checkpoint import check_finetune_layers, load_drafter_dir, read_aux_ids

        args, tc = self.args, self.tc
        self.mode = self._choose_hidden_states()
        shard_dirs = [resolve(self.workdir, s) for s in args.shards]
        mix = {"mix_dirs": [resolve(self.workdir, s) for s in args.mix_shards], "mix_share": float(args.mix_share),
               "seed": int(args.seed)}
        self.init_dir = self.vocab_path = self.weights = None
        if args.init_from:
            self.init_dir = init_dir(self.workdir, args.init_from)
            self.cfg, self.weights = load_drafter_dir(self.init_dir, tc)
            ids = read_aux_ids(json.loads((self.init_dir / "config.json").read_text()), tc.num_hidden_layers,
                               tc.model_type)
            self.data = self._data(shard_dirs, mix, list(ids.ours))
            check_finetune_layers(self.init_dir, ids, self.data.aux_layer_ids,  # before a single step
                                  tc.num_hidden_layers)
            self.reporter.log(f"finetuning {self.init_dir}: its draft vocab ({self.cfg.draft_vocab_size}), aux layers "
                              f"{ids.describe()} and {self.cfg.num_hidden_layers} draft layer(s) are reused")
            # what is trained, in the metadata and fingerprint
            self.hp = self.hp.model_copy(update={"num_layers": self.cfg.num_hidden_layers})
            return
        from safetensors.torch import load_file

        self.vocab_path = resolve(self.workdir, args.vocab)
        vocab = load_file(str(self.vocab_path))
        self.d2t, self.t2d = d2t, t2d = vocab["d2t"], vocab["t2d"]
        if t2d.shape[0] != tc.vocab_size:
            raise StageError(f"vocab mapping {args.vocab}: field t2d covers {t2d.shape[0]} target ids but the "
                             f"target vocab has {tc.vocab_size}: it was built for another model; rematerialize "
                             "vocab_mapping")
        if int((torch.arange(d2t.shape[0]) + d2t).max()) >= tc.vocab_size or int(t2d.sum()) != d2t.shape[0]:
            raise StageError(f"vocab mapping {args.vocab}: d2t and t2d disagree (d2t maps to ids outside the "
                             "target vocab or t2d marks a different number of ids): rematerialize vocab_mapping")
        self.data = self._data(shard_dirs, mix, None)
        self.cfg = DraftConfig.from_target(tc, d2t.shape[0], self.data.aux_layer_ids)
        if not 1 <= int(self.hp.num_layers) <= tc.num_hidden_layers:
            raise StageError(f"num_layers must be between 1 and the target's {tc.num_hidden_layers} layers, got "
                             f"{self.hp.num_layers}")
        self.cfg.num_hidden_layers = int(self.hp.num_layers)

    def _choose_hidden_states(self) -> str:
        """offline | online. With conversations: what offline shards of them would take on disk against the
        free disk of the output directory, reported; `auto` goes online when they would not fit with a margin."""
        from ...common.shard_format import DEFAULT_STORAGE, DISK_MARGIN, choose_hidden_states, shards_bytes
        from ..files import require_file
        from .online import Conversations

        args, tc = self.args, self.tc
        self.convs, self.estimate = None, {}
        if args.conversations:
            path = require_file(resolve(self.workdir, args.conversations), "regenerated conversations",
                                "materialize the conversations asset first")
            self.convs = Conversations(path, int(args.max_length))
        if self.convs is None:
            return "offline" if args.hidden_states == "auto" else str(args.hidden_states)
        tokens, hidden = self.convs.tokens, int(tc.hidden_size)
        storage = DEFAULT_STORAGE  # what the extraction would write
        where = self.out
        while not where.exists():
            where = where.parent
        free = shutil.disk_usage(where).free
        self.estimate = {"offline_shards_tokens": tokens, "offline_shards_storage": storage,
                         "offline_shards_bytes": shards_bytes(tokens, hidden, storage),
                         "offline_shards_bytes_fp8": shards_bytes(tokens, hidden, "fp8"),
                         "offline_shards_bytes_bf16": shards_bytes(tokens, hidden, "native", "bfloat16"),
                         "free_disk_bytes": free}
        mode, why = choose_hidden_states(str(args.hidden_states), self.estimate["offline_shards_bytes"], free,
                                         bool(args.shards), DISK_MARGIN)
        if self.group.is_main:
            self.reporter.log(
                f"offline shards of {args.conversations} ({len(self.convs.refs):,} samples, {tokens:,} tokens, hidden "
                f"{hidden}) would take {size_text(self.estimate['offline_shards_bytes_fp8'])} in fp8 (format v2) "
                f"or {size_text(self.estimate['offline_shards_bytes_bf16'])} in bf16; {size_text(free)} are "
                f"free under {where}: {why} -> {mode}")
        if mode == "offline" and not args.shards:
            raise StageError(f"hidden_states auto chose offline ({why}), but no shards were given: materialize "
                             "hidden_state_shards and pass them, or set hidden_states online")
        return mode

    def _data(self, shard_dirs: list, mix: dict, finetune_ids: list[int] | None):
        """The training data: the shards (offline), or the conversations with the target computing their
        hidden states batch by batch (online; aux layers: the setting, a finetune's own, or the default)."""
        if self.mode == "offline":
            return ShardSet(shard_dirs, self.tc.hidden_size, **mix)
        from ...common.shard_format import LAYER_CONVENTION, default_aux_layers
        from ..compute_dtype import choice, line
        from ..shards.parts import check_aux_layers
        from .online import OnlineStates

        args, n = self.args, int(self.tc.num_hidden_layers)
        if args.mix_shards:
            raise StageError("mix_shards (old shards mixed in) needs hidden_states offline: the online path reads "
                             "the conversations alone")
        aux = list(args.aux_layers or finetune_ids or default_aux_layers(n))
        check_aux_layers(aux, n)
        if args.online_from == "vllm":
            return self._engine_data(aux, n)
        info = choice(args.dtype, self.device)
        data = OnlineStates(self.convs, self.target, aux, info["dtype"], self.device, int(args.target_batch_tokens))
        if self.group.is_main:
            self.reporter.log(f"online hidden states: the target {self.target} beside the drafter on {self.device} "
                              f"({line(info)}), aux layers {aux} ({LAYER_CONVENTION}) + final pre-norm, computed "
                              "batch by batch; no shard is written")
        return data

    def _engine_data(self, aux: list[int], num_layers: int):
        """Online from vLLM: the engine started here, on this host, for the whole run (one process)."""
        from ...stages.extract import ExtractSettings
        from .engine_online import EngineStates

        settings = ExtractSettings(**self.args.online_engine)
        data = EngineStates(self.convs, self.target, aux, num_layers, settings, self.reporter,
                            self.out / "vllm-online.log", self.device)
        self.reporter.log(f"online hidden states from {data.source} (aux layers {aux}, the extraction's convention), "
                          f"streamed one batch ahead of the drafter's step; no shard is written")
        return data

    def _build_model(self) -> None:
        hp, cfg, head, device = self.hp, self.cfg, self.head, self.device
        model = self.model = Eagle3Drafter(cfg, head.embed.float())
        if self.weights is None:
            init_weights(model)
            model.d2t.copy_(self.d2t)
            model.t2d.copy_(self.t2d)
            if hp.init_head == "target":  # the target's own final norm and output rows: a head that already
                with torch.no_grad():         # speaks its vocab, fed a hidden state like the target's last one
                    model.lm_head.weight.copy_(head.lm_head[torch.arange(cfg.draft_vocab_size) + self.d2t].float())
                    model.norm.weight.copy_(head.norm_weight.float())
        else:
            missing, unexpected = model.load_state_dict(self.weights, strict=False)
            assert set(missing) <= {"embed_tokens.weight", "aux_scale"} and not unexpected, (missing, unexpected)
        if hp.init_layer is not None and self.weights is None:
            self._init_layers_from_target()
        scale = aux_rms_scale(self.data, self.tc.hidden_size) if hp.aux_scale == "rms" or hp.noise_std else None
        if hp.aux_scale == "rms" and self.weights is None:
            model.aux_scale.copy_(scale)
        # noise relative to each aux layer's typical size
        self.noise = (float(hp.noise_std) / scale).to(device) if hp.noise_std else None
        model.to(device)
        head.to(device=device, dtype=self.dtype)
        if self.fast and self.bf16:  # the frozen embeddings are only ever read as bf16 there: half the memory
            model.embed_tokens.to(torch.bfloat16)
        if self.fast and compile_on():
            model.compile_layers()
        for p in model.embed_tokens.parameters():
            p.requires_grad_(False)
        model.lm_head.weight.requires_grad_(bool(hp.train_lm_head))

    def _init_layers_from_target(self) -> None:
        """The draft's n layers from n consecutive target layers ending at init_layer (-1: the last)."""
        from ..target.head import load_target_layer
        from .drafter import LLAMA_LAYER_TENSORS, init_extra_layer, init_from_target_layer

        model, tc = self.model, self.tc
        last = int(self.hp.init_layer) % tc.num_hidden_layers
        first = last - len(model.layers)
        if first < 0:
            raise StageError(f"init_layer {self.hp.init_layer} leaves no room for {self.cfg.num_hidden_layers} "
                             f"draft layers before it: use an init_layer of at least {self.cfg.num_hidden_layers - 1}, "
                             "or -1")
        at_random = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            init_from_target_layer(model, load_target_layer(self.target, first, LLAMA_LAYER_TENSORS))
            for i, extra in enumerate(model.layers.values(), 1):
                init_extra_layer(extra, load_target_layer(self.target, first + i, LLAMA_LAYER_TENSORS))
            self.reporter.log(f"draft layer initialised from target layer {last}" if first == last else
                              f"draft layers initialised from target layers {', '.join(map(str, range(first, last + 1)))}")
        except (ValueError, StageError) as e:  # an MoE or MLA target: its layers do not fit a dense draft layer
            model.load_state_dict(at_random)  # all at random, not half from the target
            self.reporter.log(f"draft layers initialised at random: target layers {first}..{last} do not fit ({e})",
                              "warning")

    def _make_labels_and_plans(self) -> None:
        hp, device, group = self.hp, self.device, self.group
        d2t_ids, to_draft = draft_index(self.model)
        self.head.restrict(d2t_ids)
        if self.mode == "online":  # each batch's labels come with its hidden states
            self.data.label_with(self.head, to_draft, self.dtype, self.bf16)
            self.labels = None
        else:
            with self.reporter.progress("target labels", len(self.data.refs), unit="samples") as prog, \
                    autocast(device, self.bf16):
                self.labels = target_labels(self.data, self.head, to_draft, device, self.dtype, progress=prog)
        self.row_tokens, self.rows_per = row_tokens, rows_per = int(hp.row_tokens), int(hp.rows_per_batch)
        # Where rows are padded to a fixed shape (the GPU path) a fuller row is cheaper; on the CPU a batch is
        # only as long as its longest row, and next-fit keeps the plans the CPU recipes were tuned on.
        self.window = window = PACK_WINDOW if self.fast else 1
        self.held = None
        if self.args.eval_shards:  # held-out hidden states: acceptance on data the drafter never saw, per epoch
            held_data = ShardSet([resolve(self.workdir, s) for s in self.args.eval_shards], self.tc.hidden_size,
                                 self.cfg.aux_layer_ids)
            with autocast(device, self.bf16):
                held_labels = target_labels(held_data, self.head, to_draft, device, self.dtype)
            self.held = (held_data, held_labels, plan_batches([r.length for r in held_data.refs], 0, 0, row_tokens,
                                                              rows_per, window))
        self.lengths = [r.length for r in self.data.refs]
        self.plans = [plan_batches(self.lengths, e, int(hp.seed), row_tokens, rows_per, window)
                      for e in range(int(hp.epochs))]
        # One optimizer step takes `world` consecutive batches of the plan, one per rank: the same data order
        # for any GPU count.
        self.steps_of = [[plan[i: i + group.world] for i in range(0, len(plan), group.world)] for plan in self.plans]
        self.total_steps = self.requested_steps = sum(len(p) for p in self.steps_of)
        self.steps_per_epoch = len(self.steps_of[0]) if self.steps_of else 0

    def _make_optimizer(self) -> None:
        hp, model = self.hp, self.model
        self.params = params = [p for p in model.parameters() if p.requires_grad]
        # layer_lr scales the decoder layers' learning rate (their norms too): started from the target's last
        # layer they must move further than fc, the final norm and lm_head (measured best at 3x)
        layer_ids = {id(p) for m in (model.midlayer, model.layers) for p in m.parameters()}
        lr = float(hp.lr)
        groups = [{"params": [p for p in params if id(p) not in layer_ids], "lr": lr},
                  {"params": [p for p in params if id(p) in layer_ids], "lr": lr * float(hp.layer_lr)}]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=float(hp.weight_decay),
                                     **({"fused": True} if self.fast else {}))  # one kernel per step on the GPU
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(self.total_steps, max(1, int(self.total_steps * hp.warmup_ratio))))

    # ---- resume -----------------------------------------------------------------------------------------
    def resume(self) -> None:
        """Continue this very run's latest checkpoint (same inputs by content, settings and code), or start
        afresh and delete another run's checkpoints: they are never published under this run's inputs."""
        group = self.group
        names = [str(self.args.conversations)] if self.mode == "online" else [str(s) for s in self.args.shards]
        self.fp = fingerprint(self.hp, self.bf16, self.target, self.data, names, self.vocab_path, self.init_dir,
                              self.window)
        self.step = 0
        state = resumable_state(self.ckpts, self.fp, self.device, self.reporter) if self.args.resume else None
        group.barrier()  # every rank has decided before rank 0 deletes anything
        self.planned = None  # steps a time budget fits, once planned
        if state is not None:
            self.model.load_state_dict(state["model"], strict=False)
            self.opt.load_state_dict(state["optimizer"])
            self.sched.load_state_dict(state["scheduler"])
            # the state was loaded onto the training device; the CPU generator takes only a CPU tensor
            torch.set_rng_state(state["rng"].cpu())
            self.step = state["step"]
            self.planned = state.get("planned_steps")
            if self.planned:  # a time budget's plan holds for the whole run, not re-timed on resume
                self.total_steps = replan(self.steps_of, self.sched, self.planned, float(self.hp.warmup_ratio))
            self.reporter.log(f"resuming from step-{self.step:07d} (step {self.step} of {self.total_steps}): same "
                              "inputs, settings and code")
        elif self.ckpts.exists() and group.is_main:
            shutil.rmtree(self.ckpts)
        group.barrier()
        self.resumed_from = self.step
        if group.is_main:
            self.reporter.tracker = open_tracker(str(self.hp.tracker), self.out, self.step)

    # ---- evaluation -------------------------------------------------------------------------------------
    def measure(self, data, rows_plan, labels, loss_on: str = "responses"):
        # held-out figures always count replies only: that is where an engine drafts
        make = None
        if self.mode == "online" and data is self.data:
            def make(rows):
                return data.device_batch(rows, self.row_tokens, loss_on, self.rows_per, pad=self.fast)
        return evaluate(self.model, self.head, data, rows_plan, self.row_tokens, int(self.hp.ttt_steps),
                        float(self.hp.step_decay), self.dtype, self.device, self.bf16, labels, loss_on,
                        self.rows_per, make=make)

    def evaluate_heldout(self, epoch: int) -> None:
        accept = self.measure(self.held[0], self.held[2], self.held[1])[2]
        self.heldout_curve["epoch"].append(epoch + 1)
        self.heldout_curve["acceptance_length"].append(round(1 + sum(accept[:3]), 4))
        self.reporter.log(f"epoch {epoch + 1}: held-out acceptance length (k=3) {1 + sum(accept[:3]):.3f}")
        self.reporter.scalars(self.step, **{"heldout/acceptance_length_k3": 1 + sum(accept[:3])})

    def _track(self, pending: list, force: bool) -> None:
        """The tracker's points since the last host sync, read at once (on the GPU path only where the loop
        syncs anyway: checkpoints, finite checks, the end), so tracking adds no sync per step."""
        if not pending or (self.fast and not force):
            return
        values = torch.stack([v for _, v, _ in pending]).tolist()
        k = len(values[0]) // 2
        for (step, _, lr), row in zip(pending, values):
            self.reporter.scalars(step, **{f"train/loss_{i}": row[i] for i in range(k)},
                                  **{f"train/acc_{i}": row[k + i] for i in range(k)}, **{"train/lr": lr})
        pending.clear()

    # ---- training ---------------------------------------------------------------------------------------
    def _not_finite(self, at: int) -> StageError:
        ends = list(itertools.accumulate(len(p) for p in self.steps_of))
        return StageError(
            f"the training loss is not finite (NaN or inf) at step {at} of {self.total_steps} (epoch "
            f"{1 + sum(e < at for e in ends)}); nothing was written as the drafter. Lower lr (now {self.hp.lr}) "
            f"or max_grad_norm, or set precision fp32; checkpoints up to step {at - 1} are kept"
            + (f" in {self.ckpts}" if self.ckpts.exists() else ""))

    def _check_finite(self) -> None:
        """GPU path: the flags of the steps since the last check, read at once (a host sync): before any
        checkpoint and every FINITE_CHECK_EVERY steps. Every rank checks at the same steps."""
        at = int(self.bad_at)
        first = -self.group.max(-float(at) if at else -math.inf)
        if first != math.inf:
            raise self._not_finite(int(first))

    def train_step(self, batch) -> tuple[list, list]:
        """One optimizer step on this rank's batch (None: the epoch's last step left this rank without one)."""
        group, hp = self.group, self.hp
        finite = losses = accs = None
        if batch is not None:
            with autocast(self.device, self.bf16):
                loss, losses, accs, _, _ = ttt_loss(self.model, self.head, batch, int(hp.ttt_steps),
                                                    float(hp.step_decay), self.dtype, self.noise,
                                                    hp.loss == "hard")
            loss.backward()
            finite = torch.isfinite(loss.detach())
        if not self.fast:  # every rank stops together, before the step is applied
            if group.sum(0.0 if finite is None or bool(finite) else 1.0):
                raise self._not_finite(self.step + 1)
        elif finite is not None:  # no sync: recorded, read by _check_finite
            self.bad_at = torch.where((self.bad_at == 0) & ~finite, torch.full_like(self.bad_at, self.step + 1),
                                      self.bad_at)
        group.all_reduce_grads(self.params)
        torch.nn.utils.clip_grad_norm_(self.params, float(hp.max_grad_norm))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return losses, accs

    def _calibrate_budget(self, prog) -> None:
        """A time budget: time the first steps after the warm-up one, then cut the run to the steps that fit."""
        budget, hp = float(self.hp.time_budget_s), self.hp
        if self.step - self.resumed_from == 1:
            _sync(self.device)
            self.t_first = time.monotonic()  # the first step warms up; time the next ones
        elif self.step - self.resumed_from == CALIBRATION_STEPS + 1:
            _sync(self.device)
            self.planned = plan_budget(time.monotonic(), self.t0, self.t_first, budget, self.step, self.total_steps,
                                       self.group)
            if self.planned < self.total_steps:
                self.total_steps = replan(self.steps_of, self.sched, self.planned, float(hp.warmup_ratio))
                prog.set_total(self.total_steps)
            self.reporter.log(f"time budget {budget:g} s: {self.planned:,} of {self.requested_steps:,} steps "
                              f"({self.planned / max(self.steps_per_epoch, 1):.1f} of {int(hp.epochs)} epochs) "
                              "fit; the learning-rate schedule is planned for those",
                              "warning" if self.planned < self.steps_per_epoch else "info")

    def _recheck_budget(self, prog) -> None:
        """At an epoch's end: if the machine got slower since the calibration, cut the later epochs to what
        still fits (before the epoch's checkpoint, which records the plan a resume keeps)."""
        if not self.hp.time_budget_s or self.planned is None or self.resumed_from:
            return
        _sync(self.device)
        now = time.monotonic()
        last_t, last_step = getattr(self, "_pace_mark", (self.t_first, self.resumed_from + 1))
        self._pace_mark = (now, self.step)
        if self.step <= last_step:
            return
        fit = recheck_budget(now, self.t0, float(self.hp.time_budget_s), self.step, self.total_steps,
                             (now - last_t) / (self.step - last_step), self.group)
        if fit is None:
            return
        self.planned = self.total_steps = replan(self.steps_of, self.sched, max(fit, self.step),
                                                 float(self.hp.warmup_ratio))
        prog.set_total(self.total_steps)
        self.reporter.log(f"time budget {float(self.hp.time_budget_s):g} s: the last epoch ran slower than "
                          f"the calibration; {self.planned:,} steps now fit "
                          f"({self.planned / max(self.steps_per_epoch, 1):.1f} epochs), the schedule replanned",
                          "warning")

    def checkpoint(self, epoch: int, end_of_epoch: bool) -> None:
        """Written by a thread (the next steps run meanwhile), published atomically; every rank waits."""
        if self.group.is_main:
            self.writer.save(self.ckpts / f"step-{self.step:07d}", self.model, self.opt, self.sched,
                             {"step": self.step, "epoch": epoch + int(end_of_epoch), "fingerprint": self.fp,
                              "planned_steps": self.planned})
        self.group.barrier()

    def _batches(self) -> Prefetcher:
        """This rank's batches from the resume point on, in step order: made ahead of the loop on the GPU."""
        items, k = [], 0
        for epoch, plan in enumerate(self.steps_of):
            for b, group_rows in enumerate(plan):
                if k >= self.step and self.group.rank < len(group_rows):
                    items.append(((epoch, b), group_rows[self.group.rank]))
                k += 1
        if self.mode == "online":  # the target's forward for the next batch runs on the prefetcher's thread and
            # stream while this batch's step runs (one batch ahead: each holds the states of row_tokens x
            # rows_per_batch tokens)
            return Prefetcher(items, lambda rows: self.data.host_batch(rows, self.row_tokens, str(self.hp.loss_on),
                                                                       self.rows_per, pad=self.fast, pin=self.fast),
                              self.device, depth=1, finish=self.data.finish)
        return Prefetcher(items, lambda rows: host_batch(self.data, rows, self.row_tokens, self.labels,
                                                         str(self.hp.loss_on), self.rows_per, pad=self.fast,
                                                         pin=self.fast, stored=self.fast), self.device,
                          finish=on_device)

    def fit(self) -> None:
        """Every epoch's steps from the resume point on; held-out evaluation and a checkpoint at each epoch's
        end (and every save_every_steps)."""
        hp, group, device = self.hp, self.group, self.device
        steps_k = int(hp.ttt_steps)
        # A fixed probe of the training data, measured before and after: did this run teach the drafter?
        self.probe = self.plans[0][group.rank: int(self.args.probe_batches): group.world] if self.plans else []
        self.before = self.measure(self.data, self.probe, self.labels, str(hp.loss_on))
        self.heldout_curve = {"epoch": [], "acceptance_length": []}
        save_every = int(hp.save_every_steps)
        sum_loss = torch.zeros(steps_k, device=device)  # figures stay on the device until the end: no sync per step
        sum_acc = torch.zeros(steps_k, device=device)
        n_batches, tokens, self.t0 = 0, 0, time.monotonic()
        curve, curve_every, curve_at = {"step": [], "loss_0": [], "acc_0": []}, max(1, self.total_steps // 200), []
        self.bad_at = torch.zeros((), dtype=torch.long, device=device)  # GPU path: first non-finite step (0: none)
        track_every, tracked = max(1, self.total_steps // 1000), []
        batches = self._batches()
        try:
            with self.reporter.progress("train", self.total_steps, unit="steps") as prog:
                prog.update(self.step)
                done = 0
                for epoch, plan in enumerate(self.steps_of):
                    for b, group_rows in enumerate(plan):
                        if done < self.step:
                            done += 1
                            continue
                        batch = None
                        if group.rank < len(group_rows):
                            key, batch = next(batches)
                            assert key == (epoch, b), (key, epoch, b)
                        losses, accs = self.train_step(batch)
                        done += 1
                        if hp.time_budget_s and self.planned is None:
                            self._calibrate_budget(prog)
                        # every rank's real tokens, from the plan: no collective, no sync
                        ntok = sum(batch_tokens(self.lengths, r, self.row_tokens, self.rows_per) for r in group_rows)
                        tokens += ntok
                        mine = ntok and batch is not None
                        if group.is_main and mine and self.step % curve_every == 0:
                            curve["step"].append(self.step)  # the values are read at the end
                            curve_at.append(torch.stack([losses[0], accs[0]]))
                        if group.is_main and mine and self.step % track_every == 0:
                            tracked.append((self.step, torch.cat([torch.stack(losses), torch.stack(accs)]).float(),
                                            self.sched.get_last_lr()[0]))
                        if epoch == len(self.steps_of) - 1 and mine:
                            sum_loss += torch.stack(losses).float()  # the last epoch's figures describe the
                            sum_acc += torch.stack(accs).float()     # final weights (rank 0's share of them)
                            n_batches += 1
                        prog.update(1, tokens=ntok)
                        end_of_epoch = b == len(plan) - 1
                        save = end_of_epoch or (save_every and self.step % save_every == 0)
                        synced = save or self.step % FINITE_CHECK_EVERY == 0 or self.step == self.total_steps
                        if self.fast and synced:
                            self._check_finite()
                        self._track(tracked, synced)
                        if end_of_epoch and self.held is not None and group.is_main:
                            self.evaluate_heldout(epoch)
                        if end_of_epoch:
                            self._recheck_budget(prog)
                        if save:
                            self.checkpoint(epoch, end_of_epoch)
            _sync(device)
        finally:
            batches.close()
            if batches.summary() and group.is_main:
                self.reporter.log(batches.summary())
            # the loader's figures (GPU path): a wait near 0 means the step never starved for data
            self.loader = {"loader_batch_ms": round(1e3 * batches.make_s / batches.made, 1),
                           "loader_wait_s": round(batches.wait_s, 2)} if batches.made else {}
            self.writer.wait()  # the last checkpoint is complete before anything is published (or the error raised)
        self.curve = curve
        for loss_0, acc_0 in torch.stack(curve_at).tolist() if curve_at else []:
            curve["loss_0"].append(round(loss_0, 5))
            curve["acc_0"].append(round(acc_0, 5))
        self.wall = time.monotonic() - self.t0
        self.tokens_per_s = tokens / max(self.wall, 1e-9)
        n = max(n_batches, 1)
        self.acc, self.loss_per = (sum_acc.cpu() / n).tolist(), (sum_loss.cpu() / n).tolist()

    # ---- publish ----------------------------------------------------------------------------------------
    def memory(self) -> dict:
        """On a GPU, what this rank holds, in GiB: the target's weights (online), the drafter's weights (with the
        frozen embeddings and the target's head), the optimizer's state, and the peak allocated over the run."""
        if not self.device.startswith("cuda"):
            return {}

        def gib(tensors) -> float:
            return round(sum(t.numel() * t.element_size() for t in tensors) / 2**30, 3)

        model = getattr(self.data, "model", None)  # online from the target: its weights are here too
        target = [*model.parameters(), *model.buffers()] if model is not None else []
        state = [v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return {"gpu_mem_target_gib": gib(target),
                "gpu_mem_drafter_gib": gib([*self.model.parameters(), *self.model.buffers(), *self.head.parameters(),
                                            *([self.head.draft_lm_head] if hasattr(self.head, "draft_lm_head") else [])]),
                "gpu_mem_optimizer_gib": gib(state),
                "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)}

    def publish(self) -> None:
        """The final weights as the canonical checkpoint (rank 0), and the run's figures as metadata."""
        from .checkpoint import save_drafter_dir, weights_hash

        hp, group, tc, cfg = self.hp, self.group, self.tc, self.cfg
        after = self.measure(self.data, self.probe, self.labels, str(hp.loss_on))
        final_held = self.measure(self.held[0], self.held[2], self.held[1]) if self.held is not None and \
            group.is_main else None
        model_dir = self.out / "model"
        if not group.is_main:
            return
        bad = [k for k, v in self.model.export_state().items()
               if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise StageError(f"the trained drafter holds NaN or inf in {', '.join(bad[:5])}: not written to "
                             f"{model_dir}. Lower lr or set precision fp32, and check the hidden-state shards")
        save_drafter_dir(self.model, model_dir, target_info={"path": str(self.target), "model_type": tc.model_type,
                                                             "num_layers": tc.num_hidden_layers})
        init = self.args.init_from
        before, acc, loss_per, curve = self.before, self.acc, self.loss_per, self.curve
        source = (f"online, from conversations {self.args.conversations} with target {self.args.target}"
                  + (f" through engine {self.data.source}" if hasattr(self.data, "engine") else "")
                  if self.mode == "online" else f"offline, from shards {', '.join(self.args.shards)}")
        meta = {
            "path": str(model_dir),
            "hidden_states": self.mode,
            "hidden_states_source": source,
            "hidden_state_bytes_written": 0,  # training writes none: offline they were written by the extraction
            **({"online_parity": getattr(self.data, "parity", None)} if hasattr(self.data, "engine") else {}),
            **self.estimate,
            **self.memory(),
            "init": "finetune" if init else "scratch",
            "init_from": str(init) if init else "",
            "draft_vocab_size": cfg.draft_vocab_size,
            "aux_layer_ids": cfg.aux_layer_ids,
            "draft_vocab_source": f"reused from {init}" if init else str(self.args.vocab),
            "epochs": int(hp.epochs),
            "epochs_trained": round(self.step / max(self.steps_per_epoch, 1), 2),
            "steps": self.step,
            "data_order": _order_digest([s for epoch in self.steps_of for s in epoch][:self.step]),
            "requested_steps": self.requested_steps,
            "time_budget_s": hp.time_budget_s,
            "resumed_from_step": self.resumed_from,
            "ttt_steps": int(hp.ttt_steps),
            "train_tokens_per_epoch": self.data.tokens,
            **({f"mix_{k}": v for k, v in self.data.mix.items()} if self.args.mix_shards else {}),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "wall_s": round(self.wall, 1),
            **self.loader,
            "device": self.device,
            "compute": "bf16 autocast, fp32 master weights" if self.bf16 else "float32",
            **({} if self.device.startswith("cuda") else cpu_info()),
            "data_parallel_processes": group.world,
            "gpus": group.world if self.device.startswith("cuda") else 0,  # one per data-parallel process
            "simulated_acceptance_length": round(simulated_acceptance_length(acc), 4),
            "probe_loss_0_before": round(before[0][0], 5) if before[0] else None,
            "probe_loss_0_after": round(after[0][0], 5) if after[0] else None,
            "probe_acc_0_before": round(before[1][0], 5) if before[1] else None,
            "probe_acc_0_after": round(after[1][0], 5) if after[1] else None,
            "probe_simulated_acceptance_length": round(simulated_acceptance_length(after[1]), 4),
            "probe_acceptance_length_k3": round(1 + sum(after[2][:3]), 4),
            "bf16_compute": self.bf16,
            **({"heldout_acceptance_length_k3": round(1 + sum(final_held[2][:3]), 4),
                **{f"heldout_accept_{i}": round(a, 4) for i, a in enumerate(final_held[2])},
                "heldout_curve": self.heldout_curve} if final_held else {}),
            **{f"acc_{i}": round(a, 5) for i, a in enumerate(acc)},
            **{f"loss_{i}": round(x, 5) for i, x in enumerate(loss_per)},
            "hyperparameters": {k: getattr(hp, k) for k in HYPERPARAMETERS},
            "fingerprint": self.fp,
            "training_curve": curve,
            "training_curve_chart": charts.curves({"loss (unroll step 0)": curve["loss_0"],
                                                   "accuracy (unroll step 0)": curve["acc_0"]}),
        }
        version = weights_hash(model_dir)
        self.reporter.scalars(self.step, **{"final/simulated_acceptance_length": meta["simulated_acceptance_length"],
                                            "final/tokens_per_s": meta["tokens_per_s"]})
        self.reporter.materialize(metadata=meta, data_version=version)
        self.reporter.result({**{k: meta[k] for k in ("path", "steps", "simulated_acceptance_length", "tokens_per_s",
                                                      "wall_s", "data_parallel_processes", "hidden_states",
                                                      "hidden_states_source", "hidden_state_bytes_written")},
                              **{k: meta[k] for k in meta if k.startswith("gpu_mem_")},
                              "data_version": version, "acc": acc, "loss": loss_per})


def _order_digest(steps: list) -> str:
    """What a run trained on, in order (each step's batches of sample rows), as 16 hex digits: equal for an
    uninterrupted run and a resumed one, offline or online, wherever the plan is the same."""
    return hashlib.sha256(json.dumps(steps, default=int).encode()).hexdigest()[:16]


def run(workdir: str, args: TrainArgs, reporter) -> None:
    """Stage `train` (args: stages.train.TrainArgs, validated, every default filled in)."""
    if int(args.num_processes) > 1 and "RANK" not in os.environ:
        from .distributed import launch

        return launch(workdir, args, reporter, int(args.num_processes))
    trainer = Trainer(workdir, args, reporter)
    try:
        trainer.setup()
        trainer.resume()
        trainer.fit()
        trainer.publish()
    finally:
        close = getattr(getattr(trainer, "data", None), "close", None)
        if close is not None:  # online: the target's hooks, or the engine streaming to us
            close()
        if reporter.tracker is not None:
            reporter.tracker.close()
            reporter.tracker = None
