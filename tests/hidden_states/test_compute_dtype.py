"""Stages pick their compute dtype from what the CPU can do (bf16 only with bf16 instructions, where it is
~80x faster than emulated bf16), say so in the log and the metadata, and an explicit dtype still wins.
The probe is forced with EAGLE3_CPU_BF16 so that both paths run on any machine."""

from __future__ import annotations

import json

import pytest

from conftest import run_stage
from eagle3_assets.worker import compute_dtype


@pytest.fixture
def stage_forced(monkeypatch):
    """Run a stage with the CPU probe forced one way (`force`: "0", "1"), or as the CPU is (None)."""
    def run(workdir, stage, args, force=None):
        if force is None:
            monkeypatch.delenv(compute_dtype.FORCE_ENV, raising=False)
        else:
            monkeypatch.setenv(compute_dtype.FORCE_ENV, force)
        compute_dtype.cpu.cache_clear()  # the probe is read once per process: this one runs several stages
        done = run_stage(workdir, stage, args)
        compute_dtype.cpu.cache_clear()
        assert done.returncode == 0, done.stderr[-3000:]
        meta = json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
        return meta, done.stderr

    return run


@pytest.mark.parametrize("force,dtype,why", [("0", "float32", "CPU without bf16 instructions"),
                                             ("1", "bfloat16", "CPU with bf16 instructions")])
def test_extraction_on_a_cpu_chooses_its_dtype_from_the_cpu(built, tmp_path, force, dtype, why, stage_forced):
    meta, log = stage_forced(built.workdir, "extract", {
        "target": built.latest("target_model")["path"], "conversations": "conversations/conversations.parquet",
        "shard": 0, "samples_per_shard": 1, "out_dir": str(tmp_path / "hs")}, force)
    assert meta["dtype"] == meta["manifest"]["dtype"] == dtype and meta["dtype_choice"] == why
    assert meta["cpu_bf16_probe"] == f"EAGLE3_CPU_BF16={force}" and meta["cpu"] and "cpu_isa" in meta
    assert f"computing in {dtype} ({why}) on {meta['cpu']}" in log


def test_an_explicit_dtype_wins_over_the_cpu_probe(built, tmp_path, stage_forced):
    meta, _ = stage_forced(built.workdir, "extract", {
        "target": built.latest("target_model")["path"], "conversations": "conversations/conversations.parquet",
        "shard": 0, "samples_per_shard": 1, "out_dir": str(tmp_path / "hs"), "dtype": "bfloat16"}, "0")
    assert meta["dtype"] == "bfloat16" and meta["dtype_choice"] == "set"


def test_training_without_bf16_instructions_computes_in_float32(built, tmp_path, stage_forced):
    built.materialize("vocab_mapping")
    meta, log = stage_forced(built.workdir, "train", {
        "target": built.latest("target_model")["path"], "shards": ["hidden_states/shard-00000"],
        "vocab": "vocab/vocab_mapping.safetensors", "epochs": 1, "ttt_steps": 2, "row_tokens": 128,
        "rows_per_batch": 1, "out": str(tmp_path / "d"), "resume": False}, "0")
    assert meta["compute"] == "float32" and meta["cpu_bf16"] is False
    assert "training in float32 (precision auto)" in log
