"""Online training (`hidden_states: online`): the target computes the hidden states beside the drafter, batch by
batch, and nothing is written; the batches, the loss and the trained weights are those of the offline path on the
same conversations and seed, a killed online run resumes at its step, and `auto` decides by the disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import last_json, run_stage

VOCAB_SIZE, DRAFT = 256, 64
# float32 everywhere (extraction, the online target, training): the two paths then differ only by rounding
TRAIN = {"epochs": 1, "lr": 3e-3, "ttt_steps": 2, "row_tokens": 64, "rows_per_batch": 2, "warmup_ratio": 0.0,
         "precision": "fp32", "probe_batches": 2, "init_layer": None}
CONVERSATIONS = "conversations/conversations.parquet"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 4-layer random Llama target, 11 conversations (one without a reply token: skipped by both paths),
    a draft vocab, and the offline shards of the conversations (2 partitions, float32, native storage)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    work = tmp_path_factory.mktemp("online")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(work / "target")
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(11):
        n = int(torch.randint(12, 90, (), generator=g))
        mask = [0] * (n // 3) + [1] * (n - n // 3) if i != 4 else [0] * n
        rows.append({"id": f"c{i}", "input_ids": torch.randint(0, VOCAB_SIZE, (n,), generator=g).tolist(),
                     "loss_mask": mask})
    (work / "conversations").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), work / CONVERSATIONS)
    used = torch.sort(torch.randperm(VOCAB_SIZE, generator=g)[:DRAFT]).values
    t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    t2d[used] = True
    (work / "vocab").mkdir()
    save_file({"d2t": used - torch.arange(DRAFT), "t2d": t2d}, str(work / "vocab/vocab_mapping.safetensors"))
    for shard in (0, 1):
        done = run_stage(work, "extract", {"target": "target", "conversations": CONVERSATIONS, "shard": shard,
                                           "samples_per_shard": 6, "dtype": "float32", "storage": "native",
                                           "batch_tokens": 128, "max_length": 80})
        assert done.returncode == 0, done.stderr[-3000:]
    return work


def _offline(**kw) -> dict:
    return {"target": "target", "shards": ["hidden_states/shard-00000", "hidden_states/shard-00001"],
            "vocab": "vocab/vocab_mapping.safetensors", **TRAIN, **kw}


def _online(**kw) -> dict:
    return {"target": "target", "hidden_states": "online", "conversations": CONVERSATIONS, "max_length": 80,
            "dtype": "float32", "target_batch_tokens": 128, "vocab": "vocab/vocab_mapping.safetensors", **TRAIN, **kw}


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model" / "model.safetensors"))


def test_online_batches_are_the_offline_ones(tiny):
    """Same samples, same plan, and per batch the hidden states and labels the shards give (to rounding)."""
    from eagle3_assets.worker.target.head import load_target_head
    from eagle3_assets.worker.training.data import ShardSet, collate, plan_batches
    from eagle3_assets.worker.training.evaluate import target_labels
    from eagle3_assets.worker.training.online import Conversations, OnlineStates

    shards = ShardSet([tiny / "hidden_states/shard-00000", tiny / "hidden_states/shard-00001"], 64)
    convs = Conversations(tiny / CONVERSATIONS, 80)
    online = OnlineStates(convs, tiny / "target", shards.aux_layer_ids, "float32", "cpu", 128)
    assert [r.length for r in convs.refs] == [r.length for r in shards.refs] and len(convs.refs) == 10
    vocab = load_file(str(tiny / "vocab/vocab_mapping.safetensors"))
    used = torch.arange(DRAFT) + vocab["d2t"]
    to_draft = torch.full((VOCAB_SIZE,), -1, dtype=torch.long)
    to_draft[used] = torch.arange(DRAFT)
    head = load_target_head(tiny / "target", 1e-6)
    head.restrict(used)
    labels = target_labels(shards, head, to_draft, "cpu", torch.float32)
    online.label_with(head, to_draft, torch.float32, False)
    lengths = [r.length for r in shards.refs]
    for epoch in (0, 1):
        plan = plan_batches(lengths, epoch, 0, 64, 2)
        assert plan == plan_batches([r.length for r in convs.refs], epoch, 0, 64, 2)
        for rows in plan:
            off = collate(shards, rows, 64, labels, 2)
            on = online.device_batch(rows, 64, "responses", 2)
            for k in ("input_ids", "loss_mask", "doc", "pos", "t_draft"):
                assert torch.equal(off[k], on[k]), k
            for k in ("aux", "final"):
                torch.testing.assert_close(on[k], off[k], rtol=1e-5, atol=1e-5)
    online.close()


def test_one_online_training_equals_the_offline_one_and_writes_no_hidden_states(tiny, monkeypatch):
    """`auto` with no shards on a disk too small for them goes online; it trains as the offline run does on
    the shards of the same conversations, and writes nothing but the drafter."""
    off = run_stage(tiny, "train", _offline(out="drafter/offline"))
    assert off.returncode == 0, off.stderr[-3000:]
    before = {p for p in tiny.rglob("*") if p.is_file()}

    free = shutil.disk_usage(tiny)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: free._replace(free=1000))
    on = run_stage(tiny, "train", _online(out="drafter/online", hidden_states="auto"))
    assert on.returncode == 0, on.stderr[-3000:]
    assert "would take" in on.stderr and "less than they need with a 20% margin -> online" in on.stderr
    a, b = last_json(off.stdout), last_json(on.stdout)
    assert a["hidden_states"] == "offline" and b["hidden_states"] == "online"
    assert b["hidden_states_source"] == f"online, from conversations {CONVERSATIONS} with target target"
    assert b["hidden_state_bytes_written"] == 0 and b["steps"] == a["steps"] > 1
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["acc"] == pytest.approx(a["acc"], abs=1e-6)
    wa, wb = _weights(tiny / "drafter/offline"), _weights(tiny / "drafter/online")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)
    written = {p for p in tiny.rglob("*") if p.is_file()} - before
    assert written and all(p.is_relative_to(tiny / "drafter/online") or ".eagle3" in p.parts for p in written)
    meta = json.loads(next(x for x in on.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
    assert meta["offline_shards_bytes_fp8"] == meta["offline_shards_tokens"] * (4 * 64 + 25)
    assert meta["fingerprint"]["hidden states"] == "online"
    assert f"online from conversations {CONVERSATIONS}" in meta["fingerprint"]

    monkeypatch.setattr(shutil, "disk_usage", lambda p: free._replace(free=10**15))
    roomy = run_stage(tiny, "train", _online(out="drafter/roomy", hidden_states="auto"))
    assert roomy.returncode != 0 and "auto chose offline" in roomy.stderr and "no shards were given" in roomy.stderr


def test_a_killed_online_run_resumes_at_its_step_and_ends_as_an_uninterrupted_one(tiny):
    base = _online(epochs=12, save_every_steps=1, probe_batches=0)
    straight = run_stage(tiny, "train", {**base, "out": "drafter/straight"})
    assert straight.returncode == 0, straight.stderr[-3000:]
    steps = last_json(straight.stdout)["steps"]

    cmd = [sys.executable, "-m", "eagle3_assets.worker", "train", "--workdir", str(tiny), "--args",
           json.dumps({**base, "out": "drafter/killed"})]
    env = {**os.environ, "EAGLE3_NO_BAR": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tiny / "drafter/killed/checkpoints/latest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (latest.exists() and json.loads(latest.read_text())["step"] >= 3):
        assert proc.poll() is None, "training finished before it could be interrupted"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tiny / "drafter/killed/model").exists()
    at = json.loads(latest.read_text())["step"]
    assert at < steps
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {at} of {steps})" in resumed.stderr or "resuming from step-" in resumed.stderr
    assert last_json(resumed.stdout)["steps"] == steps
    a, b = _weights(tiny / "drafter/straight"), _weights(tiny / "drafter/killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_shards_estimate_and_the_auto_choice():
    from eagle3_assets.common.shard_format import choose_hidden_states, shards_bytes

    # Kimi-K2.5's shape: hidden 7168, 10,000 samples of 8,192 tokens on average
    tokens = 10_000 * 8192
    assert shards_bytes(tokens, 7168, "native", "bfloat16") == tokens * (4 * 7168 * 2 + 9)  # 4.70 TB
    assert shards_bytes(tokens, 7168, "fp8") == tokens * (4 * 7168 + 25)  # 2.35 TB: 1 byte a value + scales
    assert round(shards_bytes(tokens, 7168, "fp8") / 1e12, 2) == 2.35
    need = 100 * 10**9
    assert choose_hidden_states("auto", need, 119 * 10**9, have_shards=False)[0] == "online"  # < 20 % to spare
    assert choose_hidden_states("auto", need, 121 * 10**9, have_shards=False)[0] == "offline"
    assert choose_hidden_states("auto", need, 1, have_shards=True)[0] == "offline"  # on disk already
    assert choose_hidden_states("offline", need, 1, have_shards=False)[0] == "offline"  # as set
    assert choose_hidden_states("online", 1, 10**15, have_shards=True)[0] == "online"
