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
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from . import charts
from .checkpoint_writer import CheckpointWriter
from .compute_dtype import cpu as cpu_info
from .drafter import DraftConfig, Eagle3Drafter, init_weights
from .errors import StageError
from .files import check_plain_name, hash_files, resolve, sha256_file
from .prefetch import Prefetcher
from .target import load_config, text_config, weight_files
from .target_head import load_target_head
from .train_data import ShardSet, batch_tokens, collate, plan_batches
from .ttt_loss import compile_on, draft_index, gpu_path, ttt_loss

TRAIN_KEYS = ("epochs", "lr", "warmup_ratio", "max_grad_norm", "ttt_steps", "row_tokens", "rows_per_batch", "seed",
              "step_decay", "loss_on", "train_lm_head", "init_head", "precision", "aux_scale", "noise_std",
              "weight_decay", "init_layer", "loss", "layer_lr", "num_layers", "time_budget_s")
DEFAULTS = dict(epochs=3, lr=1e-4, warmup_ratio=0.015, max_grad_norm=0.5, ttt_steps=7, row_tokens=2048,
                rows_per_batch=4, seed=0, step_decay=0.8, save_every_steps=0, loss_on="all",
                train_lm_head=True, init_head="target", precision="auto", aux_scale="none", noise_std=0.0,
                weight_decay=0.0, init_layer=-1, loss="soft", layer_lr=1.0, num_layers=1,
                time_budget_s=None)
CALIBRATION_STEPS = 6  # steps timed before a time budget plans the run (the first, warming up, not counted)
PACK_WINDOW = 8  # GPU path: open rows a sample may go into (first fit), for fuller fixed-shape rows
FINITE_CHECK_EVERY = 50  # GPU path: steps between reads of the non-finite-loss flag (each read is a host sync)


def target_labels(data: ShardSet, head, to_draft: torch.Tensor, device: str, dtype, chunk_tokens: int = 16384,
                  progress=None) -> list[torch.Tensor]:
    """Per sample, the target's greedy next token as a draft id (-1: not in the draft vocab). Computed once
    through the full lm_head, so that every training step needs only the draft vocab's rows."""
    out: list[torch.Tensor] = [None] * len(data.refs)  # type: ignore[list-item]
    pending: list[tuple[int, torch.Tensor]] = []

    def flush():
        finals = torch.cat([f for _, f in pending]).to(device, dtype)
        with torch.no_grad():
            labels = to_draft[head(finals).argmax(-1)].to("cpu", torch.int32)
        o = 0
        for i, f in pending:
            out[i] = labels[o: o + f.shape[0]]
            o += f.shape[0]
        if progress is not None:
            progress.update(len(pending))
        pending.clear()

    size = 0
    for i, ref in enumerate(data.refs):
        pending.append((i, data.read(ref)["final"]))
        size += ref.length
        if size >= chunk_tokens:
            flush()
            size = 0
    if pending:
        flush()
    return out


def aux_rms_scale(data: ShardSet, hidden: int, samples: int = 64) -> torch.Tensor:
    """1 / (median per-token RMS) of each aux layer over a fixed sample of the data, per channel."""
    step = max(1, len(data.refs) // samples)
    aux = torch.cat([data.read(r)["aux"].float() for r in data.refs[::step]])
    rms = aux.view(aux.shape[0], 3, hidden).pow(2).mean(-1).sqrt().median(0).values.clamp(min=1e-6)
    return (1.0 / rms).repeat_interleave(hidden)


def _lr_lambda(total_steps: int, warmup: int):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return f


def _plan_budget(now: float, t0: float, t_first: float, budget: float, step: int, total: int, group) -> int:
    """How many steps fit the training time budget, from the calibration steps' pace (every rank agrees: the
    slowest sets it). 3 % is kept back for the epoch-end checkpoints."""
    per_step = group.max((now - t_first) / CALIBRATION_STEPS)
    left = group.max(budget - (now - t0))
    return max(step + 1, min(total, step + int(0.97 * left / per_step)))


def _replan(steps_of: list[list], sched, planned: int, warmup_ratio: float) -> int:
    """Cut the epoch plans (in place) to their first `planned` steps and schedule the learning rate for that
    many: warmup and decay over the run that will happen, not the one that was asked for."""
    left = planned
    for i, plan in enumerate(steps_of):
        if left <= 0:
            del steps_of[i:]
            break
        del plan[left:]
        left -= len(plan)
    sched.lr_lambdas = [_lr_lambda(planned, max(1, int(planned * warmup_ratio)))] * len(sched.lr_lambdas)
    return planned


def simulated_acceptance_length(accs: list[float]) -> float:
    """1 (the bonus token) + Σ_k Π_{j≤k} acc_j, comparable to the engines' mean acceptance length."""
    total, prod = 1.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total


def bf16_compute(device: str, precision: str = "auto") -> bool:
    """bf16 matmuls with fp32 master weights: on GPU, and on CPUs with bf16 instructions (AVX512-BF16, AMX),
    where it doubles training speed; `precision` fp32 or bf16 forces it."""
    if precision != "auto":
        return precision == "bf16"
    from .compute_dtype import cpu

    return device.startswith("cuda") or cpu()["cpu_bf16"]


def autocast(device: str, bf16: bool | None = None):
    bf16 = device.startswith("cuda") if bf16 is None else bf16
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def evaluate(model, head, data, plan, row_tokens: int, steps: int, decay: float, dtype, device, bf16=None,
             labels=None, loss_on: str = "responses", rows_per_batch: int = 1) -> tuple[list, list, list]:
    """Mean per-step loss, accuracy and chain acceptance over `plan`, without updating."""
    sums = torch.zeros(3, steps, device=device)
    with torch.no_grad(), autocast(device, bf16):
        for rows in plan:
            batch = batch_on(data, rows, row_tokens, device, labels, loss_on, rows_per_batch)
            _, losses, accs, _, accept = ttt_loss(model, head, batch, steps, decay, dtype)
            sums += torch.stack([torch.stack(xs).float() for xs in (losses, accs, accept)])
    n = max(len(plan), 1)
    return tuple((x / n).tolist() for x in sums.cpu())


def host_batch(data, rows, row_tokens: int, labels=None, loss_on: str = "responses", rows_per_batch: int = 1,
               pad: bool = False, pin: bool = False) -> dict:
    batch = collate(data, rows, row_tokens, labels, rows_per_batch, pad=pad, pin=pin)
    if loss_on == "all":  # the target's predictions on prompt tokens are training signal too
        batch["loss_mask"].copy_(batch["doc"] >= 0)
    return batch


def batch_on(data, rows, row_tokens: int, device: str, labels=None, loss_on: str = "responses",
             rows_per_batch: int = 1) -> dict:
    """A batch on `device`; on the GPU path padded to its fixed shape (`train_data.batch_shape`)."""
    fast = gpu_path(device)
    batch = host_batch(data, rows, row_tokens, labels, loss_on, rows_per_batch, pad=fast, pin=fast)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# Bounds a value must meet, checked before any work: (key, test, what it must be).
_BOUNDS = (("epochs", lambda v: v >= 1, "at least 1"), ("ttt_steps", lambda v: v >= 1, "at least 1"),
           ("row_tokens", lambda v: v >= 1, "at least 1"), ("rows_per_batch", lambda v: v >= 1, "at least 1"),
           ("num_layers", lambda v: v >= 1, "at least 1"), ("lr", lambda v: v > 0, "positive"),
           ("max_grad_norm", lambda v: v > 0, "positive"), ("step_decay", lambda v: v > 0, "positive"),
           ("warmup_ratio", lambda v: 0 <= v < 1, "in [0, 1)"), ("noise_std", lambda v: v >= 0, "0 or more"),
           ("weight_decay", lambda v: v >= 0, "0 or more"), ("layer_lr", lambda v: v >= 0, "0 or more"),
           ("save_every_steps", lambda v: v >= 0, "0 or more"),
           ("time_budget_s", lambda v: v is None or v > 0, "positive (or None: no budget)"))


def check_args(args: dict, hp: dict) -> None:
    """Refuse what cannot make a sensible run, before anything is read or written: an output that would leave
    the work directory, and counts or rates out of range (epochs 0 would publish an untrained drafter)."""
    if ".." in Path(str(args["out"])).parts:
        raise StageError(f"out {args['out']!r} contains '..': the drafter's directory must not climb out of the "
                         "place it names (a run_name is a plain name under drafter/)")
    if args.get("run_name") is not None:
        check_plain_name(args["run_name"], "run_name")
    bad = [f"{k} must be {what}, got {hp[k]!r}" for k, ok, what in _BOUNDS
           if not (hp[k] is None or isinstance(hp[k], (int, float))) or isinstance(hp[k], bool) or not ok(hp[k])]
    procs = args.get("num_processes") or 1
    if not isinstance(procs, int) or procs < 1:
        bad.append(f"num_processes must be at least 1, got {procs!r}")
    if bad:
        raise StageError("training settings out of range: " + "; ".join(bad))


# The modules whose code decides the trained weights: a change to any of them invalidates a checkpoint.
_TRAINING_CODE = ("train", "train_data", "drafter", "chain_attention", "target_head", "distributed", "checkpoint")


def fingerprint(hp: dict, bf16: bool, target: Path, data: ShardSet, shard_names: list[str], vocab: Path | None,
                init_dir: Path | None, pack_window: int = 1) -> dict:
    """What a checkpoint's run was made of, by content, one entry per input (so a mismatch can be named).
    Cheap: shard contents by the hashes their manifests record (verified against the files by ShardSet),
    the target's and a finetune start's weights by `hash_files` (cached beside each file), the vocab file
    (a few MB) read once."""
    here = Path(__file__).parent
    code = hashlib.sha256(torch.__version__.encode())
    for m in _TRAINING_CODE:
        code.update((here / f"{m}.py").read_bytes())
    fp = {"hyperparameters": {**{k: hp[k] for k in TRAIN_KEYS}, "bf16_compute": bool(bf16),
                              **({"pack_window": pack_window} if pack_window != 1 else {})},
          "training code": code.hexdigest()[:32],
          "target weights": hash_files(weight_files(target))[:32],
          "vocab": sha256_file(vocab)[:32] if vocab is not None else None,
          "init_from weights": None}
    if init_dir is not None:
        from .checkpoint import weights_hash

        fp["init_from weights"] = weights_hash(init_dir) + sha256_file(init_dir / "config.json")[:16]
    for name, ident in zip(shard_names, data.identity):
        fp[f"shard {name}"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    return fp


def fingerprint_changes(old, new: dict) -> list[str]:
    """What differs between two fingerprints, in words; [] = the same run."""
    if not isinstance(old, dict):
        return ["the checkpoint format (written by an older version)"]
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) == new.get(k):
            continue
        if k == "hyperparameters" and isinstance(old.get(k), dict):
            keys = sorted(x for x in set(old[k]) | set(new[k]) if old[k].get(x) != new[k].get(x))
            out.append("hyperparameters (" + ", ".join(f"{x} {old[k].get(x)!r} -> {new[k].get(x)!r}" for x in keys) + ")")
        elif k not in old or k not in new:
            out.append(f"{k} ({'added' if k in new else 'removed'})")
        else:
            out.append(f"{k} (content)")
    return out


def _resumable(ckpts: Path, fp: dict, device: str, reporter):
    """The latest checkpoint's state if it belongs to this very run, else None (the reason logged)."""
    latest = ckpts / "latest.json"
    if not latest.exists():
        return None
    try:
        info = json.loads(latest.read_text())
        changes = fingerprint_changes(info.get("fingerprint"), fp)
        if changes:
            reporter.log(f"not resuming {ckpts / info['checkpoint']} (step {info.get('step')}): "
                         f"{'; '.join(changes)} changed since it was written; training afresh", "warning")
            return None
        state = torch.load(ckpts / info["checkpoint"] / "training_state.pt", map_location=device, weights_only=False)
    except Exception as e:  # a damaged checkpoint is not worth failing the run for: it is only a shortcut
        reporter.log(f"not resuming from {ckpts}: its checkpoint cannot be read ({type(e).__name__}: {e}); "
                     "training afresh", "warning")
        return None
    if fingerprint_changes(state.get("fingerprint"), fp):
        reporter.log(f"not resuming {ckpts}: its training state disagrees with latest.json; training afresh", "warning")
        return None
    return state


def _sync(device: str) -> None:
    """Wait for the GPU's queued work: only where a wall-clock reading must include it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def run(workdir: str, args: dict, reporter) -> None:
    from .checkpoint import check_finetune_layers, load_drafter_dir, read_aux_ids, save_drafter_dir
    from .distributed import Group, launch

    # None means "the default", except where None is itself a setting (init_layer: None = random init)
    hp = {**DEFAULTS, **{k: v for k, v in args.items() if k in DEFAULTS and (v is not None or k == "init_layer")}}
    check_args(args, hp)
    procs = int(args.get("num_processes") or 1)
    if procs > 1 and "RANK" not in os.environ:
        return launch(workdir, args, reporter, procs)
    out = resolve(workdir, args["out"])
    target = resolve(workdir, args["target"])
    tc = text_config(load_config(target))
    device = args.get("device", "auto")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    group = Group(device)
    device = group.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    bf16 = bf16_compute(device, str(hp["precision"]))
    if group.is_main:
        where = "" if device.startswith("cuda") else f" on {cpu_info()['cpu']} ({', '.join(cpu_info()['cpu_isa'])})"
        reporter.log(f"training in {'bf16 autocast (fp32 master weights)' if bf16 else 'float32'} "
                     f"(precision {hp['precision']}){where}")
    if hp["loss_on"] not in ("responses", "all") or hp["init_head"] not in ("target", "random") or \
            hp["aux_scale"] not in ("none", "rms") or hp["loss"] not in ("soft", "hard"):
        raise StageError(f"loss_on must be responses or all (got {hp['loss_on']!r}), init_head target or random "
                         f"(got {hp['init_head']!r}), aux_scale none or rms (got {hp['aux_scale']!r}), loss soft "
                         f"or hard (got {hp['loss']!r})")
    torch.manual_seed(int(hp["seed"]))
    if device == "cpu":
        torch.use_deterministic_algorithms(True)

    shard_dirs = [resolve(workdir, s) for s in args["shards"]]
    head = load_target_head(target, tc.rms_norm_eps)
    init = args.get("init_from")
    init_dir = vocab_path = None
    if init:
        init_dir = resolve(workdir, init)
        cfg, weights = load_drafter_dir(init_dir, tc)
        ids = read_aux_ids(json.loads((init_dir / "config.json").read_text()), tc.num_hidden_layers, tc.model_type)
        data = ShardSet(shard_dirs, tc.hidden_size)
        check_finetune_layers(init_dir, ids, data.aux_layer_ids)  # before a single step
        reporter.log(f"finetuning {init_dir}: its draft vocab ({cfg.draft_vocab_size}), aux layers "
                     f"{ids.describe()} and {cfg.num_hidden_layers} draft layer(s) are reused")
        hp["num_layers"] = cfg.num_hidden_layers  # what is trained, in the metadata and the resume fingerprint
    else:
        from safetensors.torch import load_file

        vocab_path = resolve(workdir, args["vocab"])
        vocab = load_file(str(vocab_path))
        d2t, t2d = vocab["d2t"], vocab["t2d"]
        if t2d.shape[0] != tc.vocab_size:
            raise StageError(f"vocab mapping {args['vocab']}: field t2d covers {t2d.shape[0]} target ids but the "
                             f"target vocab has {tc.vocab_size}: it was built for another model; rematerialize "
                             "vocab_mapping")
        if int((torch.arange(d2t.shape[0]) + d2t).max()) >= tc.vocab_size or int(t2d.sum()) != d2t.shape[0]:
            raise StageError(f"vocab mapping {args['vocab']}: d2t and t2d disagree (d2t maps to ids outside the "
                             "target vocab or t2d marks a different number of ids): rematerialize vocab_mapping")
        data = ShardSet(shard_dirs, tc.hidden_size)
        cfg = DraftConfig.from_target(tc, d2t.shape[0], data.aux_layer_ids)
        if not 1 <= int(hp["num_layers"]) <= tc.num_hidden_layers:
            raise StageError(f"num_layers must be between 1 and the target's {tc.num_hidden_layers} layers, got "
                             f"{hp['num_layers']}")
        cfg.num_hidden_layers = int(hp["num_layers"])
        weights = None

    if group.is_main:
        reporter.log(f"hidden-state shards checked: {data.verified_bytes / 1e6:,.1f} MB, every file's sha256 as its "
                     "manifest records, hidden states finite")
    model = Eagle3Drafter(cfg, head.embed.float())
    if weights is None:
        init_weights(model)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        if hp["init_head"] == "target":  # the target's own final norm and output rows: a head that already
            with torch.no_grad():         # speaks its vocab, fed a hidden state like the target's last one
                model.lm_head.weight.copy_(head.lm_head[torch.arange(cfg.draft_vocab_size) + d2t].float())
                model.norm.weight.copy_(head.norm_weight.float())
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert set(missing) <= {"embed_tokens.weight", "aux_scale"} and not unexpected, (missing, unexpected)
    if hp["init_layer"] is not None and weights is None:
        from .drafter import LLAMA_LAYER_TENSORS, init_extra_layer, init_from_target_layer
        from .target_head import load_target_layer

        # the draft's n layers from n consecutive target layers ending at init_layer (-1: the last)
        last = int(hp["init_layer"]) % tc.num_hidden_layers
        first = last - len(model.layers)
        if first < 0:
            raise StageError(f"init_layer {hp['init_layer']} leaves no room for {cfg.num_hidden_layers} draft layers "
                             f"before it: use an init_layer of at least {cfg.num_hidden_layers - 1}, or -1")
        at_random = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            init_from_target_layer(model, load_target_layer(target, first, LLAMA_LAYER_TENSORS))
            for i, extra in enumerate(model.layers.values(), 1):
                init_extra_layer(extra, load_target_layer(target, first + i, LLAMA_LAYER_TENSORS))
            reporter.log(f"draft layer initialised from target layer {last}" if first == last else
                         f"draft layers initialised from target layers {', '.join(map(str, range(first, last + 1)))}")
        except (ValueError, StageError) as e:  # an MoE or MLA target: its layers do not fit a dense draft layer
            model.load_state_dict(at_random)  # all at random, not half from the target
            reporter.log(f"draft layers initialised at random: target layers {first}..{last} do not fit ({e})",
                         "warning")
    scale = aux_rms_scale(data, tc.hidden_size) if hp["aux_scale"] == "rms" or hp["noise_std"] else None
    if hp["aux_scale"] == "rms" and weights is None:
        model.aux_scale.copy_(scale)
    # noise relative to each aux layer's typical size
    noise = (float(hp["noise_std"]) / scale).to(device) if hp["noise_std"] else None
    model.to(device)
    head.to(device=device, dtype=dtype)
    fast = gpu_path(device)
    if fast and bf16:  # the frozen embeddings are only ever read as bf16 there: half the memory, same values
        model.embed_tokens.to(torch.bfloat16)
    if fast and compile_on():
        model.compile_layers()
    for p in model.embed_tokens.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(bool(hp["train_lm_head"]))
    d2t_ids, to_draft = draft_index(model)
    head.restrict(d2t_ids)
    with reporter.progress("target labels", len(data.refs), unit="samples") as prog, autocast(device, bf16):
        labels = target_labels(data, head, to_draft, device, dtype, progress=prog)
    row_tokens, rows_per = int(hp["row_tokens"]), int(hp["rows_per_batch"])
    # Where rows are padded to a fixed shape (the GPU path) a fuller row is cheaper; on the CPU a batch is
    # only as long as its longest row, and next-fit keeps the plans the CPU recipes were tuned on.
    window = PACK_WINDOW if fast else 1
    held = None
    if args.get("eval_shards"):  # held-out hidden states: acceptance on data the drafter never saw, per epoch
        held_data = ShardSet([resolve(workdir, s) for s in args["eval_shards"]], tc.hidden_size, cfg.aux_layer_ids)
        with autocast(device, bf16):
            held_labels = target_labels(held_data, head, to_draft, device, dtype)
        held = (held_data, held_labels, plan_batches([r.length for r in held_data.refs], 0, 0, row_tokens, rows_per,
                                                     window))

    lengths = [r.length for r in data.refs]
    plans = [plan_batches(lengths, e, int(hp["seed"]), row_tokens, rows_per, window) for e in range(int(hp["epochs"]))]
    # One optimizer step takes `world` consecutive batches of the plan, one per rank: the same data order
    # for any GPU count.
    steps_of = [[plan[i: i + group.world] for i in range(0, len(plan), group.world)] for plan in plans]
    total_steps = sum(len(p) for p in steps_of)
    requested_steps, steps_per_epoch = total_steps, len(steps_of[0]) if steps_of else 0
    params = [p for p in model.parameters() if p.requires_grad]
    # layer_lr scales the decoder layers' learning rate (their norms too): started from the target's last
    # layer they must move further than fc, the final norm and lm_head (measured best at 3x)
    layer_ids = {id(p) for m in (model.midlayer, model.layers) for p in m.parameters()}
    groups = [{"params": [p for p in params if id(p) not in layer_ids], "lr": float(hp["lr"])},
              {"params": [p for p in params if id(p) in layer_ids], "lr": float(hp["lr"]) * float(hp["layer_lr"])}]
    opt = torch.optim.AdamW(groups, lr=float(hp["lr"]), betas=(0.9, 0.95), weight_decay=float(hp["weight_decay"]),
                            **({"fused": True} if fast else {}))  # one kernel per step on the GPU
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total_steps, max(1, int(total_steps * hp["warmup_ratio"]))))

    # A checkpoint only resumes the run it belongs to: the same inputs by content, settings and code.
    fp = fingerprint(hp, bf16, target, data, [str(s) for s in args["shards"]], vocab_path, init_dir, window)
    ckpts = out / "checkpoints"
    step = 0
    state = _resumable(ckpts, fp, device, reporter) if args.get("resume", True) else None
    group.barrier()  # every rank has decided before rank 0 deletes anything
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step = state["step"]
        if state.get("planned_steps"):  # a time budget's plan holds for the whole run, not re-timed on resume
            total_steps = _replan(steps_of, sched, state["planned_steps"], float(hp["warmup_ratio"]))
        reporter.log(f"resuming from step-{step:07d} (step {step} of {total_steps}): same inputs, settings and code")
    elif ckpts.exists() and group.is_main:
        shutil.rmtree(ckpts)  # another run's weights: never resumed, never published under this run's inputs
    group.barrier()
    resumed_from = step

    steps_k, decay = int(hp["ttt_steps"]), float(hp["step_decay"])
    # A fixed probe of the training data, measured before and after: did this run teach the drafter?
    probe = plans[0][group.rank: int(args.get("probe_batches", 8)): group.world] if plans else []
    def measure(on, rows_plan, lab, loss_on="responses"):
        # held-out figures always count replies only: that is where an engine drafts
        return evaluate(model, head, on, rows_plan, row_tokens, steps_k, decay, dtype, device, bf16, lab, loss_on,
                        rows_per)

    before = measure(data, probe, labels, str(hp["loss_on"]))
    heldout_curve = {"epoch": [], "acceptance_length": []}
    save_every = int(hp["save_every_steps"])
    sum_loss = torch.zeros(steps_k, device=device)  # figures stay on the device until the end: no sync per step
    sum_acc = torch.zeros(steps_k, device=device)
    n_batches, tokens, t0 = 0, 0, time.monotonic()
    epoch_tokens = data.tokens
    curve, curve_every, curve_at = {"step": [], "loss_0": [], "acc_0": []}, max(1, total_steps // 200), []
    budget = float(hp["time_budget_s"]) if hp["time_budget_s"] else None
    planned = state.get("planned_steps") if state else None
    t_first = None
    # this rank's batches from the resume point on, in step order: made ahead of the loop on the GPU
    items, k = [], 0
    for epoch, plan in enumerate(steps_of):
        for b, group_rows in enumerate(plan):
            if k >= step and group.rank < len(group_rows):
                items.append(((epoch, b), group_rows[group.rank]))
            k += 1
    batches = Prefetcher(items, lambda rows: host_batch(data, rows, row_tokens, labels, str(hp["loss_on"]), rows_per,
                                                        pad=fast, pin=fast), device)
    writer = CheckpointWriter()
    bad_at = torch.zeros((), dtype=torch.long, device=device)  # GPU path: the first non-finite step (0: none)

    def not_finite(at: int) -> StageError:
        ends = list(itertools.accumulate(len(p) for p in steps_of))
        return StageError(
            f"the training loss is not finite (NaN or inf) at step {at} of {total_steps} (epoch "
            f"{1 + sum(e < at for e in ends)}); nothing was written as the drafter. Lower lr (now {hp['lr']}) or "
            f"max_grad_norm, or set precision fp32; checkpoints up to step {at - 1} are kept"
            + (f" in {ckpts}" if ckpts.exists() else ""))

    def check_finite() -> None:
        """GPU path: the flags of the steps since the last check, read at once (a host sync): before any
        checkpoint and every FINITE_CHECK_EVERY steps. Every rank checks at the same steps."""
        at = int(bad_at)
        first = -group.max(-float(at) if at else -math.inf)
        if first != math.inf:
            raise not_finite(int(first))

    try:
        with reporter.progress("train", total_steps * 1, unit="steps") as prog:
            prog.update(step)
            done = 0
            for epoch, plan in enumerate(steps_of):
                for b, group_rows in enumerate(plan):
                    if done < step:
                        done += 1
                        continue
                    finite = None
                    if group.rank < len(group_rows):  # the last step of an epoch may leave a rank without a batch
                        key, batch = next(batches)
                        assert key == (epoch, b), (key, epoch, b)
                        with autocast(device, bf16):
                            loss, losses, accs, _, _ = ttt_loss(model, head, batch, steps_k, decay, dtype, noise,
                                                                hp["loss"] == "hard")
                        loss.backward()
                        finite = torch.isfinite(loss.detach())
                    if not fast:  # every rank stops together, before the step is applied
                        if group.sum(0.0 if finite is None or bool(finite) else 1.0):
                            raise not_finite(step + 1)
                    elif finite is not None:  # no sync: recorded, read by check_finite
                        bad_at = torch.where((bad_at == 0) & ~finite, torch.full_like(bad_at, step + 1), bad_at)
                    group.all_reduce_grads(params)
                    torch.nn.utils.clip_grad_norm_(params, float(hp["max_grad_norm"]))
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                    done += 1
                    if budget and planned is None:
                        if step - resumed_from == 1:
                            _sync(device)
                            t_first = time.monotonic()  # the first step warms up; time the next ones
                        elif step - resumed_from == CALIBRATION_STEPS + 1:
                            _sync(device)
                            planned = _plan_budget(time.monotonic(), t0, t_first, budget, step, total_steps, group)
                            if planned < total_steps:
                                total_steps = _replan(steps_of, sched, planned, float(hp["warmup_ratio"]))
                                prog.set_total(total_steps)
                            reporter.log(f"time budget {budget:g} s: {planned:,} of {requested_steps:,} steps "
                                         f"({planned / max(steps_per_epoch, 1):.1f} of {int(hp['epochs'])} epochs) "
                                         "fit; the learning-rate schedule is planned for those",
                                         "warning" if planned < steps_per_epoch else "info")
                    # every rank's real tokens, from the plan: no collective, no sync
                    ntok = sum(batch_tokens(lengths, r, row_tokens, rows_per) for r in group_rows)
                    tokens += ntok
                    if group.is_main and ntok and group.rank < len(group_rows) and step % curve_every == 0:
                        curve["step"].append(step)  # the values are read at the end
                        curve_at.append(torch.stack([losses[0], accs[0]]))
                    if epoch == len(steps_of) - 1 and ntok and group.rank < len(group_rows):
                        sum_loss += torch.stack(losses).float()  # the last epoch's figures describe the
                        sum_acc += torch.stack(accs).float()     # final weights (rank 0's share of them)
                        n_batches += 1
                    prog.update(1, tokens=ntok)
                    end_of_epoch = b == len(plan) - 1
                    save = end_of_epoch or (save_every and step % save_every == 0)
                    if fast and (save or step % FINITE_CHECK_EVERY == 0 or step == total_steps):
                        check_finite()
                    if end_of_epoch and held is not None and group.is_main:
                        accept = measure(held[0], held[2], held[1])[2]
                        heldout_curve["epoch"].append(epoch + 1)
                        heldout_curve["acceptance_length"].append(round(1 + sum(accept[:3]), 4))
                        reporter.log(f"epoch {epoch + 1}: held-out acceptance length (k=3) {1 + sum(accept[:3]):.3f}")
                    if save:
                        if group.is_main:
                            writer.save(ckpts / f"step-{step:07d}", model, opt, sched,
                                        {"step": step, "epoch": epoch + int(end_of_epoch), "fingerprint": fp,
                                         "planned_steps": planned})
                        group.barrier()
        _sync(device)
    finally:
        batches.close()
        if batches.summary() and group.is_main:
            reporter.log(batches.summary())
        writer.wait()  # the last checkpoint is complete before anything is published (or the error is raised)
    for loss_0, acc_0 in torch.stack(curve_at).tolist() if curve_at else []:
        curve["loss_0"].append(round(loss_0, 5))
        curve["acc_0"].append(round(acc_0, 5))
    sum_loss, sum_acc = sum_loss.cpu(), sum_acc.cpu()
    wall = time.monotonic() - t0
    after = measure(data, probe, labels, str(hp["loss_on"]))
    final_held = measure(held[0], held[2], held[1]) if held is not None and group.is_main else None
    model_dir = out / "model"
    if not group.is_main:
        return
    bad = [k for k, v in model.export_state().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise StageError(f"the trained drafter holds NaN or inf in {', '.join(bad[:5])}: not written to {model_dir}. "
                         f"Lower lr or set precision fp32, and check the hidden-state shards")
    save_drafter_dir(model, model_dir, target_info={"path": str(target), "model_type": tc.model_type,
                                                    "num_layers": tc.num_hidden_layers})
    from .checkpoint import weights_hash

    acc = (sum_acc / max(n_batches, 1)).tolist()
    loss_per = (sum_loss / max(n_batches, 1)).tolist()
    meta = {
        "path": str(model_dir),
        "init": "finetune" if init else "scratch",
        "init_from": str(init) if init else "",
        "draft_vocab_size": cfg.draft_vocab_size,
        "aux_layer_ids": cfg.aux_layer_ids,
        "draft_vocab_source": f"reused from {init}" if init else str(args.get("vocab")),
        "epochs": int(hp["epochs"]),
        "epochs_trained": round(step / max(steps_per_epoch, 1), 2),
        "steps": step,
        "requested_steps": requested_steps,
        "time_budget_s": hp["time_budget_s"],
        "resumed_from_step": resumed_from,
        "ttt_steps": steps_k,
        "train_tokens_per_epoch": epoch_tokens,
        "tokens_per_s": round(tokens / max(wall, 1e-9), 1),
        "wall_s": round(wall, 1),
        "device": device,
        "compute": "bf16 autocast, fp32 master weights" if bf16 else "float32",
        **({} if device.startswith("cuda") else cpu_info()),
        "data_parallel_processes": group.world,
        "simulated_acceptance_length": round(simulated_acceptance_length(acc), 4),
        "probe_loss_0_before": round(before[0][0], 5) if before[0] else None,
        "probe_loss_0_after": round(after[0][0], 5) if after[0] else None,
        "probe_acc_0_before": round(before[1][0], 5) if before[1] else None,
        "probe_acc_0_after": round(after[1][0], 5) if after[1] else None,
        "probe_simulated_acceptance_length": round(simulated_acceptance_length(after[1]), 4),
        "probe_acceptance_length_k3": round(1 + sum(after[2][:3]), 4),
        "bf16_compute": bf16,
        **({"heldout_acceptance_length_k3": round(1 + sum(final_held[2][:3]), 4),
            **{f"heldout_accept_{i}": round(a, 4) for i, a in enumerate(final_held[2])},
            "heldout_curve": heldout_curve} if final_held else {}),
        **{f"acc_{i}": round(a, 5) for i, a in enumerate(acc)},
        **{f"loss_{i}": round(x, 5) for i, x in enumerate(loss_per)},
        "hyperparameters": {k: hp[k] for k in TRAIN_KEYS},
        "fingerprint": fp,
        "training_curve": curve,
        "training_curve_chart": charts.curves({"loss (unroll step 0)": curve["loss_0"],
                                               "accuracy (unroll step 0)": curve["acc_0"]}),
    }
    version = weights_hash(model_dir)
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({**{k: meta[k] for k in ("path", "steps", "simulated_acceptance_length", "tokens_per_s", "wall_s",
                                             "data_parallel_processes")}, "data_version": version,
                     "acc": acc, "loss": loss_per})
