"""The hf backend over several processes of one host (`num_processes`, hidden_states/ranks.py): torchrun starts
one process per GPU, here per share of the CPU's cores; each writes its own parts of the one shard."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from conftest import run_stage
from eagle3_assets.worker.compute_dtype import cores
from eagle3_assets.worker.hidden_states.ranks import split
from eagle3_assets.worker.shards.writer import Sample
from eagle3_assets.worker.training.data import ShardSet


def _extract(built, workdir: Path, out_dir: str, **kw):
    done = run_stage(workdir, "extract", {
        "target": built.latest("target_model")["path"], "storage": "native", "dtype": "float32",
        "conversations": str(built.workdir / "conversations/conversations.parquet"), "out_dir": out_dir, "shard": 0,
        # one sample per forward in both runs: the same kernels see the same shapes (and, below, the same
        # threads), so the states are equal bit for bit whichever process computes them
        "samples_per_shard": 6, "batch_tokens": 1, **kw})
    return done, workdir / out_dir / "shard-00000"


def _metadata(stderr: str) -> dict:
    """What the stage reported for Dagster (run outside Pipes, it goes to stderr as JSON)."""
    for line in reversed(stderr.splitlines()):
        if line.startswith('{"metadata"'):
            return json.loads(line)["metadata"]
    raise AssertionError(f"no metadata in:\n{stderr[-2000:]}")


def _rows(shard: Path) -> dict[str, dict]:
    parts = {f["name"]: load_file(str(shard / f["name"]))
             for f in json.loads((shard / "manifest.json").read_text())["files"]}
    out = {}
    for r in pq.read_table(shard / "index.parquet").to_pylist():
        sl = slice(r["offset"], r["offset"] + r["length"])
        out[r["id"]] = {k: v[sl] for k, v in parts[r["part"]].items()} | {"row": r["row"]}
    return out


def test_two_processes_write_the_tensors_one_process_writes_into_one_shard(built, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cores() // 2))  # each rank's share of the cores: the same kernels' splits
    try:
        one, shard1 = _extract(built, tmp_path, "one")
    finally:
        torch.set_num_threads(threads)
    two, shard2 = _extract(built, tmp_path, "two", num_processes=2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert "launching extraction of shard 0 on 2 processes" in two.stderr
    m1, m2 = (json.loads((s / "manifest.json").read_text()) for s in (shard1, shard2))
    assert (m1["processes"], m2["processes"]) == (1, 2)
    assert m2["devices"] == ["cpu", "cpu"]
    names = sorted(f["name"] for f in m2["files"])
    assert any(n.startswith("part-r00-") for n in names) and any(n.startswith("part-r01-") for n in names)
    assert (m2["samples"], m2["tokens"], m2["loss_tokens"]) == (m1["samples"], m1["tokens"], m1["loss_tokens"])
    a, b = _rows(shard1), _rows(shard2)
    assert a.keys() == b.keys() and len(a) == 6
    for sid in a:
        assert a[sid]["row"] == b[sid]["row"]
        for k in ("input_ids", "loss_mask", "aux", "final"):
            assert torch.equal(a[sid][k], b[sid][k]), (sid, k)
    meta = _metadata(two.stderr)
    assert (meta["processes"], meta["gpus"], meta["devices"]) == (2, 0, ["cpu", "cpu"])
    assert _metadata(one.stderr)["processes"] == 1
    # training reads it as it reads any shard, every part checked against the manifest
    hidden = built.latest("target_model")["hidden_size"]
    s1, s2 = ShardSet([shard1], hidden), ShardSet([shard2], hidden)
    assert sorted(r.length for r in s1.refs) == sorted(r.length for r in s2.refs)
    assert s2.verified_bytes == m2["bytes"]  # every rank's parts hashed against the one manifest
    assert not list(tmp_path.glob("two/.tmp-*"))  # the ranks' temporary directory went with the publish


def test_more_processes_than_the_host_has_cores_is_refused_before_any_starts(built, tmp_path):
    n = cores() + 1
    done, shard = _extract(built, tmp_path, "many", num_processes=n)
    assert done.returncode == 2
    assert f"num_processes {n} is more than this CPU host's {cores()} cores" in done.stderr
    assert "launching" not in done.stderr and not shard.exists()


def test_the_split_balances_tokens_and_is_the_same_on_every_rank():
    samples = [Sample(i, f"s{i}", [0] * n, [1] * n) for i, n in enumerate([100, 10, 90, 20, 80, 30, 5])]
    shares = split(samples, 2)
    assert sorted(s.row for sh in shares for s in sh) == list(range(7))  # each sample once
    loads = [sum(len(s.input_ids) for s in sh) for sh in shares]
    assert abs(loads[0] - loads[1]) <= 100, loads
    assert [[s.row for s in sh] for sh in shares] == [[s.row for s in sh] for sh in split(list(reversed(samples)), 2)]
    assert split(samples[:1], 3)[1:] == [[], []]  # more ranks than samples: the rest write nothing
