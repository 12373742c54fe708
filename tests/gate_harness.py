"""The integration gate as the tests drive it on vLLM's CPU build: its settings and its verdict. Used by
tests/serving/test_integration_gate.py (the served faults) and tests/hidden_states/test_vllm_extract.py (the
hidden-state parity on the shards vLLM extracted, beside the one extraction both need)."""

from __future__ import annotations

from conftest import failure_text

EAGER = ["--enforce-eager"]
SERVE = {"dtype": "float32", "max_model_len": 1024, "ready_timeout_s": 900, "extra_args": EAGER}
GATE = {"integration_drafter": {"config": {"samples": 3, "dtype": "float32"}},
        "integration_check": {"config": SERVE}}


def gate_check(graph, config=None) -> dict:
    """The gate's verdict: always materialized; a failed one also fails the run (its check is blocking)."""
    res = graph.materialize("integration_check", partition="vllm", raise_on_error=False,
                            config={"integration_check": {"config": {**SERVE, **(config or {})}}})
    meta = graph.latest("integration_check", "vllm")
    assert meta["run_id"] == res.run_id, failure_text(res)
    (ev,) = res.get_asset_check_evaluations()
    assert ev.check_name == "integration_passes" and ev.passed == meta["passed"] == res.success
    return meta
