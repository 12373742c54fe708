"""The integration gate tells our export from the engine (issue 50, case 3), without vLLM: a tiny drafter
exported by the real write_export, read back as the engine reads it (names mapped, dtype cast) against its
checkpoint; a fault planted in the exporter (fc.weight's three aux blocks written in reverse order, the bug an
engine's concatenation order causes) is named by tensor, and the verdict puts it on the export's side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def _target_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture
def checkpoint(tmp_path) -> tuple[Path, object]:
    """A random drafter for an 8-layer Llama on its default layers, saved as training saves it (fp32)."""
    from eagle3_assets.common.shard_format import default_aux_layers
    from eagle3_assets.worker.training.checkpoint import save_drafter_dir
    from eagle3_assets.worker.training.drafter import DraftConfig, Eagle3Drafter

    tc = _target_config()
    torch.manual_seed(0)
    c = DraftConfig.from_target(tc, 64, default_aux_layers(tc.num_hidden_layers))
    model = Eagle3Drafter(c, torch.randn(tc.vocab_size, tc.hidden_size))
    with torch.no_grad():
        model.fc.weight.normal_()
        model.d2t.copy_(torch.arange(64) * 2)
        model.t2d[::4] = True
    save_drafter_dir(model, tmp_path / "drafter", {"name": "tiny"})
    return tmp_path / "drafter", tc


def _reversed_fc(monkeypatch):
    """The planted fault: write_export saves fc.weight with its aux blocks in reverse order."""
    import safetensors.torch as st

    save = st.save_file

    def faulty(tensors, path, metadata=None):
        fc = tensors["fc.weight"]
        tensors = {**tensors, "fc.weight": torch.cat(fc.chunk(3, dim=1)[::-1], dim=1).contiguous()}
        return save(tensors, path, metadata=metadata)
    monkeypatch.setattr(st, "save_file", faulty)


def test_a_correct_export_reads_back_as_the_trained_drafter(checkpoint, tmp_path):
    from eagle3_assets.worker.serving.export import compare_export, write_export

    src, tc = checkpoint
    write_export(src, tmp_path / "vllm", "vllm", tc)  # bfloat16, as served: the same tensors cast
    assert compare_export(tmp_path / "vllm", src) == {"same": True, "tensors": 14}
    # the engine's names (vLLM renames midlayer. to layers.0., a model. prefix) are the same tensors
    from safetensors.torch import load_file, save_file

    f = tmp_path / "vllm" / "model.safetensors"
    save_file({f"model.{k.replace('midlayer.', 'layers.0.')}": v for k, v in load_file(str(f)).items()}, str(f))
    assert compare_export(tmp_path / "vllm", src)["same"] is True


def test_aux_blocks_written_in_reverse_are_named_by_tensor(checkpoint, tmp_path, monkeypatch):
    from eagle3_assets.worker.serving.export import compare_export, write_export

    src, tc = checkpoint
    _reversed_fc(monkeypatch)
    write_export(src, tmp_path / "vllm", "vllm", tc)  # the export's own validation does not see it
    found = compare_export(tmp_path / "vllm", src)
    assert found["same"] is False and found["tensor"] == "fc.weight", found
    assert "the aux blocks appear reordered: its column blocks hold the trained drafter's blocks [2, 1, 0]" \
        in found["why"], found
    assert found["why"].startswith("max abs diff "), found


def test_a_changed_tensor_or_a_missing_one_is_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle3_assets.worker.serving.export import compare_export, write_export

    src, tc = checkpoint
    write_export(src, tmp_path / "vllm", "vllm", tc)
    f = tmp_path / "vllm" / "model.safetensors"
    t = load_file(str(f))
    t["midlayer.mlp.down_proj.weight"][0, 0] += 1
    save_file(t, str(f))
    found = compare_export(tmp_path / "vllm", src)
    assert found["tensor"] == "midlayer.mlp.down_proj.weight" and "1 of " in found["why"], found
    del t["norm.weight"]
    save_file(t, str(f))
    assert compare_export(tmp_path / "vllm", src) == {"same": False, "tensor": "norm.weight",
                                                      "why": "it lacks ['norm.weight']"}


# ---- the verdict: which side failed ----

DRAFTER = {"num_speculative_tokens": 3, "offline_acceptance_length": 3.129, "parity": "not checked",
           "vllm_path": "integration/export/vllm", "source": "integration/drafter"}
LOW = {"acceptance_length": 1.253, "served_method": "eagle3", "served_aux_layers": [1, 3, 4],
       "trained_aux_layers": [1, 3, 4], "draft_vocab_mapping": "same"}


def _verdict(sides):
    from eagle3_assets.assets.integration import IntegrationCheckConfig, verdict

    return verdict("vllm", DRAFTER, LOW, None, IntegrationCheckConfig(), [], sides)


def test_the_verdict_names_the_export_and_the_tensor_when_the_export_differs(checkpoint, tmp_path, monkeypatch):
    from eagle3_assets.worker.serving.export import compare_export, write_export

    src, tc = checkpoint
    _reversed_fc(monkeypatch)
    write_export(src, tmp_path / "vllm", "vllm", tc)
    passed, why, facts = _verdict({"export_readback": compare_export(tmp_path / "vllm", src),
                                   "export_offline_acceptance_length": 1.25})
    assert passed is False
    assert why.startswith("the export differs from the trained drafter at fc.weight: max abs diff "), why
    assert "the aux blocks appear reordered" in why and "Our exporter's bug, not vllm's" in why, why
    assert "eagle3_assets/worker/serving/export.py" in why and "write_export" in why, why
    assert "the offline replay on the export gives acceptance length 1.250 against 3.129" in why, why
    assert "the engine's EAGLE-3 integration is broken" not in why, why
    assert facts["export_readback"].startswith("differs at fc.weight") and facts["engine_acceptance_length"] == 1.253


def test_the_verdict_puts_the_fault_on_the_engine_when_the_export_is_the_trained_drafter():
    passed, why, facts = _verdict({"export_readback": {"same": True, "tensors": 14},
                                   "export_offline_acceptance_length": 3.129})
    assert passed is False
    assert why.startswith("the export is the trained drafter (tensor by tensor as the engine reads it, and the "
                          "offline replay on it gives 3.129 as the checkpoint's); the engine serves something "
                          "else: vllm acceptance length 1.253"), why
    assert facts["export_readback"] == "same" and facts["export_offline_acceptance_length"] == 3.129


def test_an_export_whose_replay_falls_short_is_ours_even_with_the_same_tensors():
    """Its config, not its tensors (aux ids shifted by one in the export, say): the replay on it says so."""
    passed, why, _ = _verdict({"export_readback": {"same": True, "tensors": 14},
                               "export_offline_acceptance_length": 2.1})
    assert passed is False and why.startswith("the export's tensors are the trained drafter's, but the offline "
                                              "replay on the export gives acceptance length 2.100 against 3.129"), why
    assert "Cause found" not in why.split("\n\n")[0] and "Inspect, in order" in why


def test_a_passing_engine_still_passes():
    from eagle3_assets.assets.integration import IntegrationCheckConfig, verdict

    passed, why, _ = verdict("vllm", DRAFTER, {**LOW, "acceptance_length": 3.1}, None, IntegrationCheckConfig(), [],
                             {"export_readback": {"same": True, "tensors": 14}})
    assert passed is True, why


def test_the_engine_check_stage_reads_the_export_back_before_any_server(checkpoint, tmp_path, monkeypatch):
    """The worker side the gate asks: engine_check `serve` with the export and its checkpoint (vLLM's probe faked:
    the readback needs no engine)."""
    from eagle3_assets.worker.engines import server
    from eagle3_assets.worker.serving import engine_check
    from eagle3_assets.worker.serving.export import write_export

    src, tc = checkpoint
    _reversed_fc(monkeypatch)
    write_export(src, tmp_path / "export", "vllm", tc)
    monkeypatch.undo()
    tc.save_pretrained(tmp_path / "target")
    monkeypatch.setattr(server, "probe_answer", lambda *a, **k: {
        "installed": True, "supported": True, "reasons": [], "version": "0.32.0", "architecture": "LlamaForCausalLM",
        "model_type": "llama"})

    class Reporter:
        def log(self, _):
            pass

        def result(self, r):
            self.got = r
    rep = Reporter()
    from eagle3_assets.stages.engine_check import EngineCheckArgs

    engine_check.run(str(tmp_path), EngineCheckArgs(engine="vllm", target="target", drafter="export",
                                                    trained_drafter="drafter", refuse=False), rep)
    assert rep.got["export_readback"]["tensor"] == "fc.weight" and not rep.got.get("refusal"), rep.got
    assert rep.got["export_config_diff"] == []  # a tensor written wrong, its config the checkpoint's
    json.dumps(rep.got)  # the stage's result travels as JSON
