"""Chain attention through FlexAttention: the GPU path of `drafter.chain_attention`, same math.

A query at unroll step i and position t sees the step-0 keys of its document up to t, and its own chain's
keys of steps 1..i at t. The step-0 part is one block-sparse flex attention over the step-0 keys (the KV
heads shared by their query heads: enable_gqa), with the same doc-causal block mask at every step, so the
kernel is compiled once and reads only the tiles a document's causal triangle touches; it returns its
log-sum-exp too. The chain part is i keys per query, one per earlier step at the query's own position: i
dot products per query, computed elementwise (no 128 x 128 tile per key, no key tensor of every step end
to end) and joined to the flex output by their log-sum-exp (`join_chain`, compiled on CUDA). No T x T
score matrix in memory, no repeated K/V.

The dense `drafter.chain_attention` stays the CPU path and the reference the tests compare with.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:  # torch >= 2.9; older versions return the log-sum-exp with return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

BLOCK = 128  # flex's default tile; the GPU path pads rows to a multiple of it (training/data.py: collate)
_compiled: dict = {}  # function -> its compiled form (CUDA only), made on first use


def _raise_recompile_limit() -> None:
    import torch._dynamo

    # variants: grad / no grad x the batch shapes (normal, wide rows) x the chain lengths of the join;
    # past the default limit of 8, dynamo would fall back to eager flex, which materialises every score
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))


def _compiled_fn(fn):
    """`fn` compiled once (eager flex is a slow reference that materialises the scores)."""
    if fn not in _compiled:
        _raise_recompile_limit()
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


def _attend(q, k, v, block_mask, lse: bool = False):
    """flex over the step-0 keys; with lse: (out, log-sum-exp [B, h, T] in float32, natural log)."""
    fn = _compiled_fn(flex_attention) if q.is_cuda else flex_attention
    if not lse:
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    if AuxRequest is not None:
        out, aux = fn(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)  # pragma: no cover


class ChainMasks:
    """The block mask of one batch (doc ids [B, T], -1 = padding; T a multiple of BLOCK) over the step-0
    keys: causal within each document. A padding position sees only itself (and its own chain): its output
    is never read by a real position nor counted, and padding tiles stay empty. The chain keys of steps
    1..i need no mask: each query sees exactly its own position's."""

    def __init__(self, doc: torch.Tensor, steps: int):
        B, T = doc.shape
        if T % BLOCK:
            raise ValueError(f"rows of {T} tokens: the GPU path pads rows to a multiple of {BLOCK}")
        self.T, self.steps = T, steps

        def step0(b, h, q, kv):
            dq = doc[b, q]
            return ((dq == doc[b, kv]) & (q >= kv) & (dq >= 0)) | (q == kv)

        self.base = create_block_mask(step0, B, None, T, T, device=doc.device)


def join_chain(q, out0, lse0, chain: list):
    """The step-0 attention's output and log-sum-exp joined with the chain keys of steps 1..i at each query's
    own position: an exact softmax over T0 + i keys, in float32. q, out0 [B, h, T, d]; lse0 [B, h, T];
    chain: (k, v) [B, kv, T, d] of steps 1..i."""
    B, h, T, d = q.shape
    kvh = chain[0][0].shape[1]
    rep = h // kvh
    qg = q.view(B, kvh, rep, T, d).float()
    scale = d ** -0.5
    s = [(qg * k[:, :, None].float()).sum(-1) * scale for k, _ in chain]  # [B, kv, rep, T] each
    l0 = lse0.view(B, kvh, rep, T).float()
    m = l0
    for sj in s:
        m = torch.maximum(m, sj)
    m = m.detach()
    w0 = torch.exp(l0 - m)
    ws = [torch.exp(sj - m) for sj in s]
    z = w0
    for wj in ws:
        z = z + wj
    acc = w0[..., None] * out0.view(B, kvh, rep, T, d).float()
    for wj, (_, v) in zip(ws, chain):
        acc = acc + wj[..., None] * v[:, :, None].float()
    return (acc / z[..., None]).view(B, h, T, d).to(q.dtype)


def flex_chain_attention(q, cache: list, masks: ChainMasks, attend=None):
    """q [B, h, T, d] at unroll step i = len(cache) - 1; cache: (k, v) [B, kv, T, d] of steps 0..i.
    `attend`: the attention itself (tests swap in a dense one: flex has no backward on the CPU)."""
    attend = attend or _attend
    k0, v0 = cache[0]
    # with its log-sum-exp at step 0 too (unused there): one compiled flex kernel pair for every step
    out0, lse0 = attend(q, k0, v0, masks.base, lse=True)
    if len(cache) == 1:
        return out0
    join = _compiled_fn(join_chain) if q.is_cuda else join_chain
    return join(q, out0, lse0, cache[1:])
