"""The Kimi-class preflight, second look (issue 50, case 4), on small Kimi-K2.5-shaped targets (kimi_k25 wrapping
deepseek_v3, MLA; config.json alone: the preflight reads nothing else): every cause named in the order the
server meets them; no advice to an engine this drafter cannot go to; the --attention-backend of extra_args
checked for a common block size; and the integration gate refusing before it trains, saying how to go on.
The slow tests ask the installed vLLM (its CPU build, 0.32: run them under flock /tmp/eagle3-slow.lock)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import dagster as dg
import pytest

from tiny_targets import kimi_k25_config, kimi_k25_text_config, smollm2_tokenizer

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _kimi(d: Path, *, layers: int = 4, media: bool = False, **text) -> Path:
    tc = kimi_k25_text_config(smollm2_tokenizer(), layers=layers, hidden=64, heads=8, vocab=1024).to_dict()
    cfg = kimi_k25_config({**tc, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], **text})
    if media:  # as Moonshot's config.json has it
        cfg["media_placeholder_token_id"] = 163605
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# vLLM 0.32's CPU build, as its probe answers for the tiny Kimi (cpu_mla.py, cpu_attn.py, llm_base_proposer.py)
_CPU_PAIR = {"target": {"backend": "CPU_MLA", "block_sizes": [16]},
             "draft": {"backend": "CPU_ATTN", "block_sizes": [{"multiple_of": 32}]}, "common_block_sizes": []}
PROBE = {"installed": True, "supported": True, "reasons": [], "version": "0.32.0", "model_type": "kimi_k25",
         "architecture": "KimiK25ForConditionalGeneration", "eagle_attention": {"auto": _CPU_PAIR, "CPU_MLA": _CPU_PAIR},
         "eagle_target_config_reads": [{"key": "media_placeholder_token_id", "class": "KimiK25ForConditionalGeneration",
                                        "where": "vllm/v1/spec_decode/llm_base_proposer.py: load_model",
                                        "config_class": "Kimi_K25Config", "has_default": False}]}


def test_the_gate_drafter_of_a_4_layer_target_cannot_go_to_sglang(tmp_path):
    from eagle3_assets.worker.serving.export import left_out

    found = left_out("vllm", _kimi(tmp_path / "kimi"))
    assert list(found) == ["sglang"] and "export for vllm only" in found["sglang"].lower(), found
    assert left_out("vllm", _kimi(tmp_path / "kimi-8", layers=8)) == {}


def test_a_refusal_advises_no_engine_the_drafter_cannot_go_to(tmp_path):
    """The block-size refusal and the probe's advice, where SGLang's export was left out: only what can work."""
    from eagle3_assets.worker.engines import vllm
    from eagle3_assets.worker.engines.server import _advice

    kimi = _kimi(tmp_path / "kimi", media=True)
    gone = {"sglang": "SGLang never captures the last layer ...; export for vllm only"}
    (said,) = vllm.serve_refusals(kimi, {**PROBE, "unavailable_engines": gone}, "float32", [])
    assert said.endswith("use vLLM's GPU build"), said
    (said,) = vllm.serve_refusals(kimi, PROBE, "float32", [])
    assert said.endswith("use vLLM's GPU build or SGLang"), said  # where it can go to SGLang, SGLang is advice
    width = "its MLA attention takes latent widths [320, 512, 576]; this target's is 48"
    info = {**PROBE, "supported": False, "reasons": [width], "target_shape_reasons": [width]}
    advice = _advice(vllm, {**info, "unavailable_engines": gone}, "serve EAGLE-3", "kimi_k25")
    assert "use the other engine" not in advice and "a target of a shape it takes" in advice, advice
    assert "no other engine can serve this drafter (sglang: " in advice, advice
    assert "use the other engine (sglang)" in _advice(vllm, info, "serve EAGLE-3", "kimi_k25")


@pytest.mark.slow
@needs_vllm
def test_every_cause_is_named_in_the_order_the_server_meets_them(tmp_path, monkeypatch):
    """Latent width 48 and no media_placeholder_token_id: a real server dies at load on the missing key first,
    then on the block sizes, and only a server past both would fail its first request on the width."""
    from eagle3_assets.worker.engines import vllm
    from eagle3_assets.worker.engines.server import serve_preflight
    from eagle3_assets.worker.errors import StageError
    from eagle3_assets.worker.serving.export import left_out

    monkeypatch.setenv("EAGLE3_ENGINE_CHECK_CACHE", "0")
    kimi = _kimi(tmp_path / "kimi", kv_lora_rank=32, qk_rope_head_dim=16)
    with pytest.raises(StageError) as e:
        serve_preflight(vllm, sys.executable, kimi, dtype="float32", unavailable=left_out("vllm", kimi))
    msg = str(e.value)
    assert "3 causes, in the order the server would meet them: (1) its EAGLE proposer" in msg, msg
    media, blocks, width = (msg.index(w) for w in ("has no 'media_placeholder_token_id'", "(2) this vLLM build's "
                                                   "CPU_MLA", "(3) its MLA attention takes latent widths"))
    assert media < blocks < width, msg
    # SGLang's export is left out for this 4-layer target: nothing advises it
    assert "or SGLang" not in msg and "use the other engine" not in msg, msg
    assert "no other engine can serve this drafter (sglang: " in msg, msg


@pytest.mark.slow
@needs_vllm
def test_the_attention_backend_named_in_extra_args_is_checked_for_a_common_block_size(tmp_path, monkeypatch):
    from eagle3_assets.worker.engines import vllm
    from eagle3_assets.worker.engines.server import serve_preflight
    from eagle3_assets.worker.errors import StageError

    monkeypatch.setenv("EAGLE3_ENGINE_CHECK_CACHE", str(tmp_path / "cache"))
    kimi = _kimi(tmp_path / "kimi", media=True)
    for extra in (["--attention-backend", "TRITON_MLA"], ["--attention-backend=TRITON_MLA"]):
        with pytest.raises(StageError) as e:
            serve_preflight(vllm, sys.executable, kimi, dtype="float32", extra=extra)
        msg = str(e.value)
        assert "CPU_MLA (asked for TRITON_MLA) (the MLA target's attention) takes block size 16" in msg, msg
        assert "no common block size" in msg, msg
    with pytest.raises(StageError, match="has no attention backend 'NO_SUCH'"):
        serve_preflight(vllm, sys.executable, kimi, dtype="float32", extra=["--attention-backend", "NO_SUCH"])


class _Recording:
    """The in-process host, each stage it is asked to run recorded."""

    def __init__(self, workdir: Path):
        from in_process_host import InProcessGpuHost

        class Host(InProcessGpuHost):
            def run_stage(self, context, stage, args):
                ran.append(stage)
                return super().run_stage(context, stage, args)
        ran: list[str] = []
        self.ran, self.host = ran, Host(workdir=str(workdir))


def test_the_gate_refuses_an_mla_target_on_a_cpu_host_before_it_trains(tmp_path, monkeypatch):
    """The engine's preflight (vLLM's probe answer faked as 0.32's CPU build gives it), with integration_check's
    launch settings, before integration_data, train and export: the verdict names the refusal and the way on."""
    from eagle3_assets.assets.integration import integration_check, integration_drafter
    from eagle3_assets.assets.partitions import engine_partitions
    from eagle3_assets.worker import compute_dtype
    from eagle3_assets.worker.engines import server

    monkeypatch.setattr(server, "probe_answer", lambda *a, **k: json.loads(json.dumps(PROBE)))
    monkeypatch.setattr(compute_dtype, "host_device", lambda device="auto": "cpu")
    kimi = _kimi(tmp_path / "kimi")
    rec = _Recording(tmp_path / "host")
    job = dg.define_asset_job("gate", selection=["integration_drafter", "integration_check"],
                              partitions_def=engine_partitions)
    defs = dg.Definitions(assets=[integration_drafter, integration_check], jobs=[job],
                          resources={"gpu_host": rec.host})
    instance = dg.DagsterInstance.ephemeral()
    instance.report_runless_asset_event(dg.AssetMaterialization("target_model", metadata={"path": str(kimi)}))
    res = defs.resolve_job_def("gate").execute_in_process(instance=instance, partition_key="vllm",
                                                           raise_on_error=False, run_config={"ops": {
                                                               "integration_check": {"config": {"dtype": "float32"}}}})
    assert rec.ran == ["engine_check"], rec.ran  # nothing trained, exported or served
    from eagle3_assets.assets.integration import gate_state

    passed, why = gate_state(instance, "vllm")
    assert passed is False and not res.success
    assert why.startswith("the gate refused before training its drafter: vllm 0.32.0 cannot serve"), why
    assert "2 causes, in the order the server would meet them: (1) its EAGLE proposer" in why, why
    assert "no common block size" in why and "or SGLang" not in why, why
    assert "On this host without a GPU no MLA target can pass the integration gate" in why, why
    assert "set integration_gate: skip in eagle3_drafter's config" in why and "on a GPU host" in why, why
