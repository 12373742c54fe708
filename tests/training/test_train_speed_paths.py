"""The train stage's GPU path, checked on the CPU against the CPU path it must equal: flex chain attention
(its block mask and log-sum-exp join) against the dense `chain_attention`, the GPU path's loss against the
reference loss, whole-conversation packing, batch shapes, and checkpoints written off the step loop.

FlexAttention has no backward on the CPU: where gradients are compared, the step-0 attention is computed
densely from the block mask's own mask_mod (so the mask is what is tested), and the device run of
bench/train_bench.py compares the compiled flex kernels with the dense path on the GPU."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from eagle3_assets.worker.target.head import TargetHead
from eagle3_assets.worker.training import chain_attention as ca
from eagle3_assets.worker.training import trainer as train
from eagle3_assets.worker.training import ttt_loss
from eagle3_assets.worker.training.checkpoint_writer import CheckpointWriter
from eagle3_assets.worker.training.data import _Rows, batch_shape, batch_tokens, plan_batches
from eagle3_assets.worker.training.drafter import (
    DraftConfig,
    Eagle3Drafter,
    chain_attention,
    doc_causal_mask,
    init_weights,
)


def dense_attend(q, k, v, block_mask, lse=False):
    """Flex's attention materialised: its mask_mod decides (eager flex reads only that too); with lse, the
    log-sum-exp of the scores too, as flex returns it (float32, natural log)."""
    B, h, T, d = q.shape
    allowed = create_mask(block_mask.mask_mod, B, 1, T, k.shape[2], device=q.device)
    rep = h // k.shape[1]
    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)).float() * d ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(s, -1).to(v.dtype) @ v.repeat_interleave(rep, 1)
    return (out, torch.logsumexp(s, -1)) if lse else out


def _docs():
    # two rows of 256 (two 128-token tiles): three documents and padding; one document and a short second one
    return torch.tensor([[0] * 80 + [1] * 100 + [2] * 40 + [-1] * 36, [0] * 200 + [1] * 56])


def test_flex_chain_attention_equals_the_dense_chain_attention_values_and_gradients():
    torch.manual_seed(0)
    doc, steps = _docs(), 4
    B, h, kv, T, d = 2, 4, 2, doc.shape[1], 16
    q = torch.randn(B, h, T, d, requires_grad=True)
    kvs = [(torch.randn(B, kv, T, d, requires_grad=True), torch.randn(B, kv, T, d, requires_grad=True))
           for _ in range(steps)]
    mask0, masks = doc_causal_mask(doc), ca.ChainMasks(doc, steps)
    real = (doc >= 0)[:, None, :, None]  # padding queries differ by design (they see only themselves)
    for i in range(steps):
        if i == 0:
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, kvs[0][0].repeat_interleave(2, 1), kvs[0][1].repeat_interleave(2, 1), attn_mask=mask0)
        else:
            ref = chain_attention(q, kvs[0], kvs[1:i + 1], mask0, h // kv)
        new = ca.flex_chain_attention(q, kvs[:i + 1], masks, attend=dense_attend)
        assert torch.isfinite(new).all()
        assert torch.allclose(new * real, ref * real, atol=1e-5), i
        g = torch.randn_like(ref) * real
        wrt = [q] + [t for pair in kvs[:i + 1] for t in pair]
        for a, b in zip(torch.autograd.grad(ref, wrt, g), torch.autograd.grad(new, wrt, g)):
            assert torch.allclose(a, b, atol=1e-5), i


def test_the_block_mask_covers_the_step0_mask_and_lists_no_tile_it_does_not_need():
    """The kernel reads only listed tiles and skips mask_mod on full ones: every tile with an allowed pair
    must be listed, a full tile must be all allowed, and no listed tile is empty (the causal triangle of
    each document, no more)."""
    doc = _docs()
    T, n = doc.shape[1], doc.shape[1] // ca.BLOCK
    bm = ca.ChainMasks(doc, 3).base
    allowed = create_mask(bm.mask_mod, 2, 1, T, T, device="cpu")
    real = (doc >= 0)[:, None, :, None]  # padding queries differ by design (they see only themselves)
    assert torch.equal(allowed & real, doc_causal_mask(doc) & real)
    tiles = allowed.view(2, 1, n, ca.BLOCK, n, ca.BLOCK)
    listed = bm.to_dense().bool()
    assert torch.equal(listed, tiles.any(-1).any(-2))
    full = _full_tiles(bm)
    assert (tiles.all(-1).all(-2) | ~full).all()


def test_the_chain_join_is_the_softmax_over_step0_and_chain_keys():
    """join_chain (the flex output and its log-sum-exp, then i keys per query at its own position) against
    one softmax over the concatenated scores, with values far apart (the max is taken before exp)."""
    torch.manual_seed(3)
    B, h, kv, T, d, i = 2, 4, 2, 8, 16, 3
    q = torch.randn(B, h, T, d) * 4
    k0, v0 = torch.randn(B, kv, T, d), torch.randn(B, kv, T, d)
    chain = [(torch.randn(B, kv, T, d) * 4, torch.randn(B, kv, T, d)) for _ in range(i)]
    s0 = (q @ k0.repeat_interleave(2, 1).transpose(-1, -2)) * d ** -0.5
    out0, lse0 = torch.softmax(s0, -1) @ v0.repeat_interleave(2, 1), torch.logsumexp(s0, -1)
    sd = torch.stack([(q * k.repeat_interleave(2, 1)).sum(-1) * d ** -0.5 for k, _ in chain], -1)
    p = torch.softmax(torch.cat([s0, sd], -1), -1)
    ref = p[..., :T] @ v0.repeat_interleave(2, 1) + sum(p[..., T + j, None] * v.repeat_interleave(2, 1)
                                                         for j, (_, v) in enumerate(chain))
    assert torch.allclose(ca.join_chain(q, out0, lse0, chain), ref, atol=1e-5)


def _full_tiles(bm):
    """The tiles a block mask marks full (mask_mod skipped), as a dense [B, H, nq, nk] bool."""
    B, H, nq = bm.full_kv_num_blocks.shape
    out = torch.zeros(B, H, nq, bm.full_kv_indices.shape[-1], dtype=torch.bool)
    for b in range(B):
        for r in range(nq):
            out[b, 0, r, bm.full_kv_indices[b, 0, r, : int(bm.full_kv_num_blocks[b, 0, r])].long()] = True
    return out


def test_flex_itself_agrees_with_the_dense_attention_over_the_chain_masks():
    """Forward only (flex on the CPU has no backward): the real kernel over the real masks."""
    torch.manual_seed(1)
    doc, steps = _docs(), 3
    masks = ca.ChainMasks(doc, steps)
    q = torch.randn(2, 4, doc.shape[1], 16)
    cache = [(torch.randn(2, 2, doc.shape[1], 16), torch.randn(2, 2, doc.shape[1], 16)) for _ in range(steps)]
    with torch.no_grad():
        for i in range(steps):
            out = ca.flex_chain_attention(q, cache[:i + 1], masks)
            ref = ca.flex_chain_attention(q, cache[:i + 1], masks, attend=dense_attend)
            assert torch.allclose(out, ref, atol=1e-5), i


def _tiny(seed=0):
    c = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, vocab_size=100,
                    draft_vocab_size=50, target_hidden_size=32, aux_layer_ids=[0, 1, 2], num_hidden_layers=2)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(100, 32, generator=g)
    head = TargetHead(embed, torch.ones(32), torch.randn(100, 32, generator=g), 1e-5)
    model = Eagle3Drafter(c, embed)
    torch.manual_seed(seed)
    init_weights(model, std=0.2)
    used = torch.sort(torch.randperm(100, generator=g)[:50]).values
    model.d2t.copy_(used - torch.arange(50))
    model.t2d[used] = True
    head.restrict(used)
    doc = _docs()
    pos = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        for d in doc[b].unique():
            at = doc[b] == d
            pos[b, at] = torch.arange(int(at.sum()))
    B, T = doc.shape
    batch = {"input_ids": torch.randint(0, 100, (B, T), generator=g), "doc": doc, "pos": pos,
             "loss_mask": (doc >= 0) & (torch.rand(B, T, generator=g) > 0.2), "aux": torch.randn(B, T, 96, generator=g),
             "final": torch.randn(B, T, 32, generator=g),
             "t_draft": torch.where(torch.rand(B, T, generator=g) > 0.1, torch.randint(0, 50, (B, T), generator=g), -1)}
    return model, head, batch


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
def test_the_gpu_path_loss_equals_the_cpu_path_loss_and_gradients(monkeypatch, hard):
    monkeypatch.setenv("EAGLE3_TRAIN_COMPILE", "0")
    model, head, batch = _tiny()
    ref = train.ttt_loss(model, head, batch, 4, 0.8, torch.float32, hard=hard)
    ref_grads = torch.autograd.grad(ref[0], [p for p in model.parameters() if p.requires_grad])
    monkeypatch.setattr(ttt_loss, "gpu_path", lambda device: True)
    monkeypatch.setattr(ca, "_attend", dense_attend)
    new = train.ttt_loss(model, head, batch, 4, 0.8, torch.float32, hard=hard)
    new_grads = torch.autograd.grad(new[0], [p for p in model.parameters() if p.requires_grad])
    assert torch.allclose(new[0], ref[0], rtol=1e-5)
    for i in (1, 2, 4):  # per-step losses, accuracies, chain acceptance
        assert torch.allclose(torch.stack(new[i]), torch.stack(ref[i]), rtol=1e-5, atol=1e-7), i
    assert float(torch.stack(ref[2]).sum()) > 0 or float(ref[0]) > 0
    for a, b in zip(ref_grads, new_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_under_autocast_the_gpu_path_casts_the_weights_once_and_still_equals_the_cpu_path(monkeypatch):
    """bf16 autocast (on the CPU here): the GPU path casts each weight once per unroll (`cast_weights`), as
    eager autocast caches its casts; the loss and gradients are the reference path's within bf16 rounding."""
    monkeypatch.setenv("EAGLE3_TRAIN_COMPILE", "0")
    model, head, batch = _tiny()
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = train.ttt_loss(model, head, batch, 3, 0.8, torch.float32)
    ref_grads = torch.autograd.grad(ref[0], params)
    monkeypatch.setattr(ttt_loss, "gpu_path", lambda device: True)
    monkeypatch.setattr(ca, "_attend", dense_attend)
    casts = []
    real_cast = model.cast_weights
    monkeypatch.setattr(model, "cast_weights", lambda dtype: casts.append(dtype) or real_cast(dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = train.ttt_loss(model, head, batch, 3, 0.8, torch.float32)
    new_grads = torch.autograd.grad(new[0], params)
    assert casts == [torch.bfloat16]
    assert torch.allclose(new[0], ref[0], rtol=2e-2)
    rel = [float((a - b).norm() / a.norm().clamp(min=1e-12)) for a, b in zip(ref_grads, new_grads)]
    assert max(rel) < 5e-2, rel


def _legacy_plan(n_refs, epoch, seed, row_tokens, rows_per_batch):
    """plan_batches as it was before windows and wide rows (every sample cut at row_tokens)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(n_refs), generator=g).tolist()
    batches, rows, row, used = [], [], [], 0
    for i in order:
        ln = min(n_refs[i], row_tokens)
        if row and used + ln > row_tokens:
            rows.append(row)
            row, used = [], 0
            if len(rows) == rows_per_batch:
                batches.append(rows)
                rows = []
        row.append(i)
        used += ln
    if row:
        rows.append(row)
    if rows:
        batches.append(rows)
    return batches


def test_next_fit_plans_are_the_plans_the_cpu_recipes_were_tuned_on():
    r = random.Random(0)
    for rows in (1, 2, 4):
        short = [r.randint(1, 128) for _ in range(300)]
        assert plan_batches(short, 3, 7, 128, rows) == _legacy_plan(short, 3, 7, 128, rows)
    long = [r.randint(1, 400) for _ in range(300)]  # rows_per_batch 1: long samples are cut at the row, as ever
    assert plan_batches(long, 0, 0, 128, 1) == _legacy_plan(long, 0, 0, 128, 1)


@pytest.mark.parametrize("window", [1, 8])
def test_long_conversations_go_whole_into_wide_rows(window):
    r = random.Random(1)
    lengths = [r.randint(16, 700) for _ in range(400)]
    T, rows = 128, 4
    plan = plan_batches(lengths, 2, 5, T, rows, window)
    assert plan == plan_batches(lengths, 2, 5, T, rows, window)  # deterministic in (seed, epoch)
    seen = sorted(i for batch in plan for row in batch for i in row)
    assert seen == list(range(len(lengths)))  # every sample once
    for batch in plan:
        n_rows, cap = batch_shape([[lengths[i] for i in row] for row in batch], T, rows)
        if cap > T:  # a wide row: one row of long samples, whole up to rows * T
            assert len(batch) == 1 and all(lengths[i] > T for i in batch[0])
            assert sum(min(lengths[i], cap) for i in batch[0]) <= cap
        else:
            assert len(batch) <= rows and all(sum(lengths[i] for i in row) <= T for row in batch)
        assert batch_tokens(lengths, batch, T, rows) <= n_rows * cap
    whole = sum(min(x, T * rows) for x in lengths)
    assert sum(batch_tokens(lengths, b, T, rows) for b in plan) == whole  # nothing cut below the wide cap


def test_a_window_packs_fuller_rows():
    r = random.Random(2)
    lengths = [r.randint(512, 4096) for _ in range(2000)]
    fill = {w: sum(lengths) / (8192 * len(plan_batches(lengths, 0, 0, 8192, 1, w))) for w in (1, 8)}
    assert fill[1] < 0.9 < fill[8], fill


def test_rows_first_fit_closes_the_oldest_row():
    rows = _Rows(10, 2)
    assert rows.add(0, 6) == [] and rows.add(1, 6) == [] and rows.add(2, 4) == []  # 2 joins row 0
    assert rows.add(3, 5) == [[0, 2]] and rows.rest() == [[1], [3]]


def test_collate_pads_to_the_fixed_shape_with_finite_padding(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import train_bench

    s = train_bench.SHAPES["tiny"]
    lengths = [30, 200, 50, 90]
    train_bench.make_shard(tmp_path / "shard-00000", s, lengths, "cpu")
    from eagle3_assets.worker.training.data import ShardSet, collate

    data = ShardSet([tmp_path / "shard-00000"], s["hidden"])
    labels = [torch.zeros(x, dtype=torch.int32) for x in lengths]
    normal = collate(data, [[0, 2], [3]], 64, labels, rows_per_batch=4, pad=True)  # padded to the 128 tile
    assert normal["doc"].shape == (4, 128) and normal["aux"].shape == (4, 128, 3 * s["hidden"])
    assert int((normal["doc"] >= 0).sum()) == batch_tokens(lengths, [[0, 2], [3]], 64, 4) == 64 + 64
    wide = collate(data, [[1]], 64, labels, rows_per_batch=4, pad=True)
    assert wide["doc"].shape == (1, 256) and int((wide["doc"] == 0).sum()) == 200  # whole, not cut at 64
    for batch in (normal, wide):
        assert torch.isfinite(batch["aux"].float()).all() and torch.isfinite(batch["final"].float()).all()
        assert (batch["t_draft"][batch["doc"] < 0] == -1).all()
    unpadded = collate(data, [[0, 2], [3]], 64, labels, rows_per_batch=4)
    assert unpadded["doc"].shape == (2, 64)


def test_a_checkpoint_is_a_snapshot_and_is_published_only_when_complete(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = model.weight.detach().clone()
    writer = CheckpointWriter()
    writer.save(tmp_path / "checkpoints" / "step-0000001", model, opt, sched, {"step": 1, "epoch": 0, "fingerprint": {}})
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the write is in flight
    writer.wait()
    latest = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    assert latest["checkpoint"] == "step-0000001" and latest["step"] == 1
    state = torch.load(tmp_path / "checkpoints" / "step-0000001" / "training_state.pt", weights_only=False)
    assert torch.equal(state["model"]["weight"], before)
    writer.save(tmp_path / "checkpoints" / "step-0000002", model, opt, sched, {"step": 2, "epoch": 1, "fingerprint": {}})
    writer.wait()
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-0000002"]
