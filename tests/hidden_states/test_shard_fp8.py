"""Shard format v2 (`storage: fp8`): float8 e4m3 hidden states with per-token, per-layer scales, half of
bf16 on disk, read back by training beside v1 shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import run_stage, train_args
from eagle3_assets.common.shard_format import FORMAT, FORMAT_V2, bytes_per_token
from eagle3_assets.worker.shards.parts import dequantize_fp8, quantize_fp8
from eagle3_assets.worker.training.data import ShardSet, collate, on_device, plan_batches


def test_fp8_keeps_each_layer_to_its_own_scale():
    g = torch.Generator().manual_seed(0)
    # three layers of very different size, as a residual stream grows with depth
    x = torch.cat([torch.randn(64, 96, generator=g) * s for s in (0.01, 1.0, 300.0)], dim=1)
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3)
    back = dequantize_fp8(q, scale)
    for k in range(3):
        part, got = x[:, k * 96:(k + 1) * 96], back[:, k * 96:(k + 1) * 96]
        rel = ((got - part).norm(dim=1) / part.norm(dim=1)).max()
        assert rel < 0.05, (k, float(rel))  # e4m3 keeps 3 mantissa bits: a few % per value at most


def test_fp8_is_half_of_bf16_at_the_8b_shape():
    assert bytes_per_token(4096, "bfloat16", "fp8") <= 16_500
    assert bytes_per_token(4096, "bfloat16", "fp8") / bytes_per_token(4096, "bfloat16") < 0.51


def _extract(built, workdir: Path, out_dir: str, storage: str):
    done = run_stage(workdir, "extract", {
        "target": built.latest("target_model")["path"], "storage": storage,
        "conversations": str(built.workdir / "conversations/conversations.parquet"), "out_dir": out_dir, "shard": 0,
        "samples_per_shard": 3, "dtype": "float32", "batch_tokens": 256})
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir / out_dir / "shard-00000"


def test_an_fp8_shard_is_written_checked_and_trained_on(built, work):
    native = _extract(built, work, "hs_native", "native")
    fp8 = _extract(built, work, "hs_fp8", "fp8")
    m_native, m_fp8 = (json.loads((d / "manifest.json").read_text()) for d in (native, fp8))
    assert (m_native["format"], m_fp8["format"]) == (FORMAT, FORMAT_V2) and m_fp8["storage"] == "fp8"
    assert m_fp8["tokens"] == m_native["tokens"]
    # float32 native shards here: fp8 takes a little over a quarter
    assert m_fp8["bytes"] < 0.3 * m_native["bytes"], (m_fp8["bytes"], m_native["bytes"])
    hidden = built.latest("target_model")["hidden_size"]
    a, b = ShardSet([native], hidden), ShardSet([fp8], hidden)
    for ra, rb in zip(a.refs, b.refs):
        xa, xb = a.read(ra), b.read(rb)
        assert torch.equal(xa["input_ids"], xb["input_ids"])
        for k in ("aux", "final"):
            rel = (xb[k] - xa[k].float()).norm() / xa[k].float().norm()
            assert rel < 0.05, (k, float(rel))
    with safe_open(str(sorted(fp8.glob("part-*.safetensors"))[0]), "pt") as st:
        assert st.get_slice("aux").get_dtype() == "F8_E4M3"

    # a GPU batch travels as stored (fp8 bytes + scales, padding included) and, dequantized where it lands,
    # is the batch the host would have made in float32
    labels = [torch.arange(r.length) for r in b.refs]
    for rows in plan_batches([r.length for r in b.refs], 0, 0, 64, 2):
        host = collate(b, rows, 64, labels, 2, pad=True)
        sent = collate(b, rows, 64, labels, 2, pad=True, stored=True)
        assert sent["aux"].dtype == torch.float8_e4m3fn and sent["aux_scale"].shape == (*sent["aux"].shape[:2], 3)
        assert sent["aux"].nbytes + sent["aux_scale"].nbytes < 0.3 * host["aux"].nbytes
        got = on_device(dict(sent))
        assert set(got) == set(host) and all(torch.equal(got[k], host[k]) for k in host), rows
    # ... and so are the target's labels, computed from the states as stored
    from eagle3_assets.worker.target.head import load_target_head
    from eagle3_assets.worker.training.evaluate import target_labels

    head = load_target_head(Path(built.latest("target_model")["path"]), 1e-5)
    to_draft = torch.arange(head.lm_head.shape[0])
    on_host = target_labels(b, head, to_draft, "cpu", torch.float32, chunk_tokens=32, stored=False)
    as_stored = target_labels(b, head, to_draft, "cpu", torch.float32, chunk_tokens=32, stored=True)
    assert all(torch.equal(x, y) for x, y in zip(on_host, as_stored)) and len(on_host) == len(b.refs)

    trained = run_stage(work, "train", {**train_args(built, "drafter/fp8"), "shards": ["hs_fp8/shard-00000"]})
    assert trained.returncode == 0, trained.stderr[-3000:]
    mixed = run_stage(work, "train", {**train_args(built, "drafter/mixed"),
                                    "shards": ["hs_fp8/shard-00000", "hs_native/shard-00000"]})
    assert mixed.returncode == 0, mixed.stderr[-3000:]


@pytest.mark.parametrize("planted", ["scale", "value"])
def test_a_non_finite_fp8_shard_is_refused_naming_the_file(built, work, planted):
    """The check reads fp8 as stored: an inf scale, or a NaN byte (e4m3's only non-finite value)."""
    from safetensors.torch import load_file, save_file

    from eagle3_assets.worker.files import sha256_file

    fp8 = _extract(built, work, "hs_bad", "fp8")
    part = sorted(fp8.glob("part-*.safetensors"))[0]
    tensors = load_file(str(part))
    if planted == "scale":
        tensors["aux_scale"][1, 2] = float("inf")
    else:
        tensors["final"].view(torch.uint8)[2, 5] = 0xFF  # -NaN in e4m3fn
    save_file(tensors, str(part))
    manifest = json.loads((fp8 / "manifest.json").read_text())  # re-signed: only the content is wrong
    for f in manifest["files"]:
        if f["name"] == part.name:
            f["bytes"], f["sha256"] = part.stat().st_size, sha256_file(part)
    (fp8 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="NaN or inf"):
        ShardSet([fp8], built.latest("target_model")["hidden_size"])
    assert str(part) in run_stage(work, "train", {**train_args(built, "drafter/bad"),
                                                "shards": ["hs_bad/shard-00000"]}).stderr


@pytest.mark.parametrize("storage", ["native", "fp8"])
def test_the_last_part_is_split_among_the_writers_and_every_row_reads_back(tmp_path, storage):
    """ShardWriter.close writes the part left at the end as io_threads files side by side (the producer
    waits for it alone); every sample stays whole in one part, at its own offset."""
    from safetensors.torch import load_file

    from eagle3_assets.worker.shards.writer import Sample, ShardWriter

    g = torch.Generator().manual_seed(0)
    H, lengths = 8, [5, 9, 3, 7, 11, 4, 6, 2, 8]
    w = ShardWriter(tmp_path, H, torch.float32, 30, 3, pin=False, storage=storage)
    states = {}
    for row, ln in enumerate(lengths):
        aux, final = torch.randn(ln, 3 * H, generator=g), torch.randn(ln, H, generator=g)
        states[row] = (aux, final)
        w.add([Sample(row, f"s{row}", list(range(row, row + ln)), [1] * ln)], [ln], aux, final)
    w.close()
    assert len(w.files) > 2 and len({f["name"] for f in w.files}) == len(w.files)
    assert sum(f["tokens"] for f in w.files) == sum(lengths)
    assert sorted(r["row"] for r in w.index) == list(range(len(lengths)))
    parts = {f["name"]: load_file(str(tmp_path / f["name"])) for f in w.files}
    for r in w.index:
        t, sl = parts[r["part"]], slice(r["offset"], r["offset"] + r["length"])
        assert t["input_ids"][sl].tolist() == list(range(r["row"], r["row"] + r["length"]))
        aux, final = states[r["row"]]
        if storage == "fp8":
            got_aux = dequantize_fp8(t["aux"][sl], t["aux_scale"][sl])
            got_final = dequantize_fp8(t["final"][sl], t["final_scale"][sl])
            assert (got_aux - aux).norm() / aux.norm() < 0.05 and (got_final - final).norm() / final.norm() < 0.05
        else:
            assert torch.equal(t["aux"][sl], aux) and torch.equal(t["final"][sl], final)


def test_a_shard_of_a_format_version_it_does_not_know_is_refused(built, work):
    """A manifest saying v3 (a newer writer, another tool) is never read as if it were ours."""
    shard = _extract(built, work, "hs_v3", "native")
    manifest = json.loads((shard / "manifest.json").read_text())
    manifest["format"] = "eagle3-hidden-states/v3"
    (shard / "manifest.json").write_text(json.dumps(manifest))
    hidden = built.latest("target_model")["hidden_size"]
    with pytest.raises(Exception, match="format 'eagle3-hidden-states/v3'") as e:
        ShardSet([shard], hidden)
    assert FORMAT in str(e.value) and FORMAT_V2 in str(e.value)
    done = run_stage(work, "train", {**train_args(built, "drafter/v3"), "shards": ["hs_v3/shard-00000"]})
    assert done.returncode != 0 and "eagle3-hidden-states/v3" in done.stderr, done.stderr[-2000:]
    assert not (work / "drafter/v3/model").exists()
