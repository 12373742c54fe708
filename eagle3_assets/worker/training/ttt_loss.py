"""The training-time-test loss: the draft unrolled `steps` times over a packed batch, each step scored
against the target's distribution over the draft vocab. Two paths with one answer: the dense eager one (CPU,
and the GPU reference with EAGLE3_TRAIN_EAGER=1) and the GPU one (flex chain attention, compiled step loss,
no host sync)."""

from __future__ import annotations

import os

import torch

from .chain_attention import ChainMasks
from .drafter import Eagle3Drafter, doc_causal_mask, rotary


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
    fast = gpu_path(str(batch["input_ids"].device))
    with torch.no_grad():
        if "t_draft" in batch:
            t_draft = batch["t_draft"]
            t_logits = head(batch["final"].to(dtype), draft_only=True)
        else:
            tlogits = head(batch["final"].to(dtype))
            t_draft = to_draft[tlogits.argmax(-1)]  # -1: the target's choice is not expressible in the draft vocab
            t_logits = tlogits[..., d2t_ids]
            del tlogits
        if fast:  # the target's logits (compute dtype) and log-sum-exp: its softmax is formed where it is read
            target = (t_logits, _glue(_target_lse)(t_logits))
        else:
            target_p = torch.softmax(t_logits.float(), dim=-1)
        del t_logits
    aux = batch["aux"].to(dtype)
    if noise is not None:
        aux = aux + torch.randn_like(aux) * noise.to(aux.dtype)
    hidden = model.combine(aux)
    if fast:
        return _gpu_unroll(model, batch, hidden, target, t_draft, steps, decay, hard)
    ids, doc, pos, lmask = batch["input_ids"], batch["doc"], batch["pos"], batch["loss_mask"]
    cache: list = []
    total, losses, accs, accept = 0.0, [], [], []
    one_doc = doc.shape[0] == 1 and bool((doc == 0).all())
    mask0 = None if one_doc else doc_causal_mask(doc)  # None: the fused causal kernel
    start = chain = None
    for i in range(steps):
        n = i + 1
        same = (shift(doc, n, -2) == doc) & (doc >= 0)
        counted = same & shift(lmask, n, False)
        valid = counted & (shift(t_draft, n, -1) >= 0)
        hidden = model.step(shift(ids, n), hidden, pos + i, cache, mask0)
        denom = counted.sum().clamp(min=1)
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


def _gpu_unroll(model: Eagle3Drafter, batch: dict, hidden, target, t_draft, steps: int, decay: float, hard: bool):
    """The GPU path of `ttt_loss`'s unroll, same answers: flex chain attention over one block mask, the
    first layer's embedding half of q|k|v projected once for every step (`embed_qkv`), the weights cast
    once, every step's masks made before the loop and its figures after it (a few fused kernels, not a
    dozen small ones per step), no host sync anywhere."""
    ids, doc, pos, lmask = batch["input_ids"], batch["doc"], batch["pos"], batch["loss_mask"]
    dev = ids.device.type
    wdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else model.fc.weight.dtype
    weights = model.cast_weights(wdtype)
    masks = ChainMasks(doc, steps)
    T = ids.shape[1]
    emb = model.embed_qkv(ids, steps, weights)
    counted, valid, t_next, denom = _glue(_unroll_masks)(doc, lmask, t_draft, steps)
    rope = rotary(pos[None] + torch.arange(steps, device=pos.device)[:, None, None], model.config.head_dim,
                  model.config.rope_theta, hidden.dtype)
    idx = torch.arange(T, device=ids.device)
    cache: list = []
    total, losses, preds = 0.0, [], []
    for i in range(steps):
        n = i + 1
        hidden = model.step(None, hidden, None, cache, masks, weights, emb_qkv=emb[:, n: n + T],
                            rope=(rope[0][i], rope[1][i]))
        label = t_next[i].clamp(min=0) if hard else None
        loss_i, pred = _step_loss_fn()(model, hidden, target[0], target[1], (idx + n).clamp(max=T - 1), valid[i],
                                       denom[i], label, weights[1])
        total = total + (decay ** i) * loss_i
        losses.append(loss_i.detach())
        preds.append(pred)
    if not steps:
        return total, losses, [], 0, []
    accs, accept = _glue(_unroll_figures)(torch.stack(preds), t_next, valid, counted, denom)
    return total, losses, list(accs.unbind()), counted[-1].sum(), list(accept.unbind())


def _unroll_masks(doc, lmask, t_draft, steps: int):
    """Per unroll step n = i + 1, stacked [steps, B, T]: the positions counted (same document at t + n, a
    loss position there), those valid for the loss (the target's token there is in the draft vocab), the
    target's draft token at t + n; and each step's denominator [steps]."""
    counted, valid, t_next = [], [], []
    for n in range(1, steps + 1):
        c = (shift(doc, n, -2) == doc) & (doc >= 0) & shift(lmask, n, False)
        t = shift(t_draft, n, -1)
        counted.append(c)
        valid.append(c & (t >= 0))
        t_next.append(t)
    counted = torch.stack(counted)
    return counted, torch.stack(valid), torch.stack(t_next), counted.flatten(1).sum(1).clamp(min=1)


def _unroll_figures(preds, t_next, valid, counted, denom):
    """Per step: accuracy (a right draft token at a valid position, over the counted ones) and the chain's
    acceptance (right at every step so far, over the positions counted at step 0)."""
    correct = (preds == t_next) & valid
    accs = correct.flatten(1).sum(1).float() / denom
    chain, accept = correct[0], []
    start = counted[0].sum().clamp(min=1)
    for i in range(correct.shape[0]):
        chain = chain & correct[i]
        accept.append(chain.sum().float() / start)
    return accs, torch.stack(accept)


# The GPU path: flex chain attention (chain_attention.py), compiled layer pieces and step loss, batches
# prefetched, fixed shapes, no host sync per step. EAGLE3_TRAIN_EAGER=1 runs the CPU path's dense, eager
# code on the GPU too (the reference); EAGLE3_TRAIN_COMPILE=0 keeps flex but compiles nothing else.
def gpu_path(device: str) -> bool:
    return device.startswith("cuda") and os.environ.get("EAGLE3_TRAIN_EAGER") != "1"


def compile_on() -> bool:
    return os.environ.get("EAGLE3_TRAIN_COMPILE") != "0"


def _step_loss(model, hidden, t_logits, t_lse, idx, valid, denom, label, lm_weight=None):
    """One unroll step's loss and greedy draft tokens on the GPU path: the target's distribution read at
    positions idx = t + n (no shifted copy of it per step), formed there from its logits and log-sum-exp
    (softmax = exp(logit - lse): half the bytes of a float32 copy, read twice per step), masked with `where`
    (boolean indexing would wait for the host). `label`: hard targets, or None for the soft loss."""
    logits = model.logits(hidden, lm_weight).float()
    # -sum(p * log_softmax(x)) = lse(x) * sum(p) - sum(p * x): every reduction reads the row once, none
    # waits for another's result (log_softmax first would read the row again), and the backward is one pass
    lse = torch.logsumexp(logits, dim=-1)
    if label is None:
        target_p = torch.exp(t_logits.index_select(1, idx).float() - t_lse.index_select(1, idx)[..., None])
        per = lse * target_p.sum(-1) - (target_p * logits).sum(-1)
    else:
        per = lse - logits.gather(-1, label[..., None]).squeeze(-1)
    return torch.where(valid, per, 0.0).sum() / denom, logits.argmax(-1)


def _target_lse(t_logits):
    """The target's log-sum-exp over the draft vocab, float32 (one fused pass on the GPU path)."""
    return torch.logsumexp(t_logits.float(), dim=-1)


_compiled_step_loss = None
_compiled_glue: dict = {}


def _step_loss_fn():
    global _compiled_step_loss
    if not compile_on():
        return _step_loss
    if _compiled_step_loss is None:
        _compiled_step_loss = torch.compile(_step_loss, dynamic=False)
    return _compiled_step_loss


def _glue(fn):
    """The unroll's small pieces (masks, figures, the target's log-sum-exp), compiled on the GPU path."""
    if not compile_on():
        return fn
    if fn not in _compiled_glue:
        _compiled_glue[fn] = torch.compile(fn, dynamic=False)
    return _compiled_glue[fn]
