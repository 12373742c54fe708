"""The training-time-test loss: the draft unrolled `steps` times over a packed batch, each step scored
against the target's distribution over the draft vocab. Two paths with one answer: the dense eager one (CPU,
and the GPU reference with EAGLE3_TRAIN_EAGER=1) and the GPU one (flex chain attention, compiled step loss,
no host sync)."""

from __future__ import annotations

import os

import torch

from .chain_attention import ChainMasks
from .drafter import Eagle3Drafter, doc_causal_mask


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n], padded at the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def draft_index(model: Eagle3Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """(target ids of the draft vocab, target id -> draft id or -1)."""
    d2t_ids = torch.arange(model.config.draft_vocab_size, device=model.d2t.device) + model.d2t
    to_draft = torch.full((model.config.vocab_size,), -1, dtype=torch.long, device=model.d2t.device)
    to_draft[d2t_ids] = torch.arange(model.config.draft_vocab_size, device=model.d2t.device)
    return d2t_ids, to_draft


def ttt_loss(model: Eagle3Drafter, head, batch: dict, steps: int, decay: float, dtype, noise=None,
             hard: bool = False):
    """Returns (weighted loss, [loss_i], [acc_i], positions counted, [accept_i]). accept_i: the share of
    positions whose draft chain is right at every step up to i, which is what greedy chain speculation
    accepts; 1 + sum(accept_i) estimates the acceptance length.

    With batch["t_draft"] (from `target_labels`; `head.restrict` done) only the draft vocab's target logits
    are computed; without, the full ones. `noise`: per-channel std of Gaussian noise added to the aux
    hidden states (training only): the drafter must not rely on exact values it will not see again.
    `hard`: cross-entropy on the target's greedy token instead of its whole distribution."""
    d2t_ids, to_draft = draft_index(model)
    with torch.no_grad():
        if "t_draft" in batch:
            t_draft = batch["t_draft"]
            target_p = torch.softmax(head(batch["final"].to(dtype), draft_only=True).float(), dim=-1)
        else:
            tlogits = head(batch["final"].to(dtype))
            t_draft = to_draft[tlogits.argmax(-1)]  # -1: the target's choice is not expressible in the draft vocab
            target_p = torch.softmax(tlogits[..., d2t_ids].float(), dim=-1)
            del tlogits
    ids, doc, pos, lmask = batch["input_ids"], batch["doc"], batch["pos"], batch["loss_mask"]
    aux = batch["aux"].to(dtype)
    if noise is not None:
        aux = aux + torch.randn_like(aux) * noise.to(aux.dtype)
    hidden = model.combine(aux)
    cache: list = []
    total, losses, accs, accept = 0.0, [], [], []
    fast = gpu_path(str(ids.device))
    weights = None
    if fast:  # flex attention over block masks; no host sync anywhere below
        mask0 = ChainMasks(doc, steps)
        idx = torch.arange(ids.shape[1], device=ids.device)
        if torch.is_autocast_enabled(ids.device.type):
            weights = model.cast_weights(torch.get_autocast_dtype(ids.device.type))
    else:
        one_doc = doc.shape[0] == 1 and bool((doc == 0).all())
        mask0 = None if one_doc else doc_causal_mask(doc)  # None: the fused causal kernel
    start = chain = None
    for i in range(steps):
        n = i + 1
        same = (shift(doc, n, -2) == doc) & (doc >= 0)
        counted = same & shift(lmask, n, False)
        valid = counted & (shift(t_draft, n, -1) >= 0)
        hidden = model.step(shift(ids, n), hidden, pos + i, cache, mask0, weights)
        denom = counted.sum().clamp(min=1)
        if fast:
            label = shift(t_draft, n, -1).clamp(min=0) if hard else None
            loss_i, pred = _step_loss_fn()(model, hidden, target_p, (idx + n).clamp(max=ids.shape[1] - 1), valid,
                                           denom, label, None if weights is None else weights[1])
        else:
            logits = model.logits(hidden).float()
            logp = torch.log_softmax(logits, dim=-1)
            if hard:
                label = shift(t_draft, n, -1).clamp(min=0)
                loss_i = -logp.gather(-1, label[..., None]).squeeze(-1)[valid].sum() / denom
            else:
                loss_i = -(shift(target_p, n) * logp).sum(-1)[valid].sum() / denom
            pred = logits.argmax(-1)
        correct = (pred == shift(t_draft, n, -1)) & valid
        acc_i = correct.sum().float() / denom
        if i == 0:
            start, chain = counted, correct
        else:
            chain = chain & correct
        total = total + (decay ** i) * loss_i
        losses.append(loss_i.detach())
        accs.append(acc_i.detach())
        accept.append(chain.sum().float() / start.sum().clamp(min=1))
    return total, losses, accs, counted.sum() if steps else 0, accept


# The GPU path: flex chain attention (chain_attention.py), compiled layer pieces and step loss, batches
# prefetched, fixed shapes, no host sync per step. EAGLE3_TRAIN_EAGER=1 runs the CPU path's dense, eager
# code on the GPU too (the reference); EAGLE3_TRAIN_COMPILE=0 keeps flex but compiles nothing else.
def gpu_path(device: str) -> bool:
    return device.startswith("cuda") and os.environ.get("EAGLE3_TRAIN_EAGER") != "1"


def compile_on() -> bool:
    return os.environ.get("EAGLE3_TRAIN_COMPILE") != "0"


def _step_loss(model, hidden, target_p, idx, valid, denom, label, lm_weight=None):
    """One unroll step's loss and greedy draft tokens on the GPU path: the target's distribution read at
    positions idx = t + n (no shifted copy of it per step), masked with `where` (boolean indexing would wait
    for the host). `label`: hard targets, or None for the soft loss."""
    logits = model.logits(hidden, lm_weight).float()
    logp = torch.log_softmax(logits, dim=-1)
    if label is None:
        per = -(target_p.index_select(1, idx) * logp).sum(-1)
    else:
        per = -logp.gather(-1, label[..., None]).squeeze(-1)
    return torch.where(valid, per, 0.0).sum() / denom, logits.argmax(-1)


_compiled_step_loss = None


def _step_loss_fn():
    global _compiled_step_loss
    if not compile_on():
        return _step_loss
    if _compiled_step_loss is None:
        _compiled_step_loss = torch.compile(_step_loss, dynamic=False)
    return _compiled_step_loss
