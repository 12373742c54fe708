"""What training measures without updating: the target's greedy labels, the TTT figures over a batch plan, and
the held-out acceptance of a saved drafter (`heldout_acceptance`, the public entry point for benchmarks)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .data import ShardSet, collate, on_device, plan_batches
from .ttt_loss import draft_index, gpu_path, ttt_loss


def target_labels(data: ShardSet, head, to_draft: torch.Tensor, device: str, dtype, chunk_tokens: int = 16384,
                  progress=None, stored: bool | None = None) -> list[torch.Tensor]:
    """Per sample, the target's greedy next token as a draft id (-1: not in the draft vocab). Computed once
    through the full lm_head, so that every training step needs only the draft vocab's rows. fp8 states go to
    the device as stored and are dequantized there (`stored`; None: on a GPU)."""
    out: list[torch.Tensor] = [None] * len(data.refs)  # type: ignore[list-item]
    pending: list[tuple[int, dict]] = []
    stored = data.all_fp8 and (not str(device).startswith("cpu") if stored is None else stored)

    def flush():
        parts = {k: torch.cat([s[k] for _, s in pending]).to(device) for k in pending[0][1]}
        finals = on_device(parts)["final"].to(dtype)
        with torch.no_grad():
            labels = to_draft[head(finals).argmax(-1)].to("cpu", torch.int32)
        o = 0
        for i, f in pending:
            out[i] = labels[o: o + f["final"].shape[0]]
            o += f["final"].shape[0]
        if progress is not None:
            progress.update(len(pending))
        pending.clear()

    size = 0
    for i, ref in enumerate(data.refs):
        sample = data.read(ref, stored)
        pending.append((i, {k: v for k, v in sample.items() if k.startswith("final")}))
        size += ref.length
        if size >= chunk_tokens:
            flush()
            size = 0
    if pending:
        flush()
    return out


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
    from ..compute_dtype import cpu

    return device.startswith("cuda") or cpu()["cpu_bf16"]


def autocast(device: str, bf16: bool | None = None):
    bf16 = device.startswith("cuda") if bf16 is None else bf16
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def evaluate(model, head, data, plan, row_tokens: int, steps: int, decay: float, dtype, device, bf16=None,
             labels=None, loss_on: str = "responses", rows_per_batch: int = 1, make=None) -> tuple[list, list, list]:
    """Mean per-step loss, accuracy and chain acceptance over `plan`, without updating. `make(rows)`: a batch on
    the device made otherwise than from shards (online training)."""
    sums = torch.zeros(3, steps, device=device)
    with torch.no_grad(), autocast(device, bf16):
        for rows in plan:
            batch = make(rows) if make is not None else batch_on(data, rows, row_tokens, device, labels, loss_on,
                                                                 rows_per_batch)
            _, losses, accs, _, accept = ttt_loss(model, head, batch, steps, decay, dtype)
            sums += torch.stack([torch.stack(xs).float() for xs in (losses, accs, accept)])
    n = max(len(plan), 1)
    return tuple((x / n).tolist() for x in sums.cpu())


def host_batch(data, rows, row_tokens: int, labels=None, loss_on: str = "responses", rows_per_batch: int = 1,
               pad: bool = False, pin: bool = False, stored: bool = False) -> dict:
    """`stored`: fp8 states stay as stored (`on_device` dequantizes them where the batch goes)."""
    batch = collate(data, rows, row_tokens, labels, rows_per_batch, pad=pad, pin=pin, stored=stored)
    if loss_on == "all":  # the target's predictions on prompt tokens are training signal too
        batch["loss_mask"].copy_(batch["doc"] >= 0)
    return batch


def batch_on(data, rows, row_tokens: int, device: str, labels=None, loss_on: str = "responses",
             rows_per_batch: int = 1) -> dict:
    """A batch on `device`; on the GPU path padded to its fixed shape (data.py: `batch_shape`)."""
    fast = gpu_path(device)
    batch = host_batch(data, rows, row_tokens, labels, loss_on, rows_per_batch, pad=fast, pin=fast, stored=fast)
    return on_device({k: v.to(device, non_blocking=True) for k, v in batch.items()})


def heldout_acceptance(target: Path, drafter_dir: Path, shard_dirs: list[Path], ttt_steps: int = 3,
                       first_tokens: int | None = None, row_tokens: int = 512, rows_per_batch: int = 2) -> dict:
    """Teacher-forced chain acceptance of a saved drafter on hidden-state shards, replies only, on the CPU: the
    figure `train` reports per epoch, recomputed from the saved weights. `first_tokens`: only each reply's
    first N tokens count (what a serving benchmark of N new tokens drafts on)."""
    from ..target.head import load_target_head
    from ..target.model import load_config, text_config
    from .checkpoint import load_drafter_dir
    from .drafter import Eagle3Drafter

    tc = text_config(load_config(target))
    head = load_target_head(target, tc.rms_norm_eps).float()
    cfg, weights = load_drafter_dir(drafter_dir, tc)
    model = Eagle3Drafter(cfg, head.embed.float())
    model.load_state_dict(weights, strict=False)
    d2t_ids, to_draft = draft_index(model)
    head.restrict(d2t_ids)
    data = ShardSet(list(shard_dirs), tc.hidden_size)
    if first_tokens:
        read = data.read

        def truncated(ref, stored=False):
            s = read(ref, stored)
            m = s["loss_mask"].bool()
            s["loss_mask"] = m & (m.long().cumsum(0) <= first_tokens)
            return s
        data.read = truncated
    bf16 = bf16_compute("cpu")
    with autocast("cpu", bf16):
        labels = target_labels(data, head, to_draft, "cpu", torch.float32)
    plan = plan_batches([r.length for r in data.refs], 0, 0, row_tokens, rows_per_batch)
    accept = evaluate(model, head, data, plan, row_tokens, ttt_steps, 0.8, torch.float32, "cpu", bf16, labels)[2]
    return {"acceptance_length": round(1 + sum(accept), 4), "per_position": [round(a, 4) for a in accept]}
