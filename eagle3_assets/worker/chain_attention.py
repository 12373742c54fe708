"""Chain attention through FlexAttention: the GPU path of `drafter.chain_attention`, same math.

A query at unroll step i and position t sees the step-0 keys of its document up to t, and its own chain's
keys of steps 1..i at t. Here the keys of every step are laid end to end, [k_0 | k_1 | ... | k_{n-1}]
(steps not yet run are zeros that no query sees), and one block-sparse flex attention per step reads them,
the KV heads shared by their query heads (enable_gqa): no T x T score matrix in memory, no repeated K/V.
Step i's block mask is the step-0 doc-causal blocks plus one diagonal 128 x 128 tile per query tile for
each step 1..i, so a later step costs the step-0 attention plus i small tiles. The key length is the same
at every step, so the flex kernel is compiled once.

The dense `drafter.chain_attention` stays the CPU path and the reference the tests compare with.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK = 128  # flex's default tile; the GPU path pads rows to a multiple of it (train_data.collate)
_compiled = None


def _flex():
    """flex_attention, compiled on CUDA (eager flex is a slow reference that materialises the scores)."""
    global _compiled
    if _compiled is None:
        import torch._dynamo

        # variants: grad / no grad x the batch shapes (normal, wide rows); past the default limit of 8,
        # dynamo would fall back to eager flex, which materialises every score
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 64))
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _attend(q, k, v, block_mask):
    fn = _flex() if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=True)


class ChainMasks:
    """The block masks of one batch (doc ids [B, T], -1 = padding; T a multiple of BLOCK), one per unroll
    step, over the keys of `steps` steps end to end. A padding position sees only itself (and its own
    chain): its output is never read by a real position nor counted, and padding tiles stay empty."""

    def __init__(self, doc: torch.Tensor, steps: int):
        B, T = doc.shape
        if T % BLOCK:
            raise ValueError(f"rows of {T} tokens: the GPU path pads rows to a multiple of {BLOCK}")
        self.T, self.steps = T, steps

        def step0(b, h, q, kv):
            dq = doc[b, q]
            return ((dq == doc[b, kv]) & (q >= kv) & (dq >= 0)) | (q == kv)

        base = create_block_mask(step0, B, None, T, T, device=doc.device)
        nb, dev = T // BLOCK, doc.device
        cols = steps * nb

        def widen(x):  # block columns for every step's keys
            return torch.cat([x, x.new_zeros(*x.shape[:-1], cols - nb)], -1)

        kv_n, kv_i = base.kv_num_blocks, widen(base.kv_indices)
        full_n, full_i = base.full_kv_num_blocks, base.full_kv_indices
        if full_i is not None:
            full_i = widen(full_i)
        if steps > 1:  # after each query tile's step-0 tiles: its diagonal tile in steps 1..n-1
            diag = torch.arange(nb, device=dev)[:, None] + nb * torch.arange(1, steps, device=dev)[None, :]
            slots = kv_n[..., None].long() + torch.arange(steps - 1, device=dev)
            kv_i = kv_i.scatter(-1, slots, diag.expand(*slots.shape).to(kv_i.dtype))
        limits = torch.arange(steps, device=dev)
        self.masks = [BlockMask.from_kv_blocks(kv_n + i, kv_i, full_n, full_i, BLOCK,
                                               mask_mod=self._mask_mod(doc, T, limits[i]))
                      for i in range(steps)]

    @staticmethod
    def _mask_mod(doc, T: int, limit):
        """The whole truth at step `limit` (eager flex reads only this; the kernel also skips unlisted tiles)."""
        def mask_mod(b, h, q, kv):
            s, j = kv % T, kv // T
            dq = doc[b, q]
            return (j <= limit) & ((q == s) | ((j == 0) & (dq == doc[b, s]) & (q >= s) & (dq >= 0)))
        return mask_mod


def flex_chain_attention(q, cache: list, masks: ChainMasks, attend=None):
    """q [B, h, T, d] at unroll step i = len(cache) - 1; cache: (k, v) [B, kv, T, d] of steps 0..i.
    `attend`: the attention itself (tests swap in a dense one: flex has no backward on the CPU)."""
    attend = attend or _attend
    i = len(cache) - 1
    B, kvh, T, d = cache[0][0].shape
    unseen = q.new_zeros(B, kvh, (masks.steps - 1 - i) * T, d)  # steps not run yet: never attended
    k = torch.cat([kj for kj, _ in cache] + [unseen], dim=2)
    v = torch.cat([vj for _, vj in cache] + [unseen], dim=2)
    return attend(q, k, v, masks.masks[i])
