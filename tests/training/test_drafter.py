"""The drafter half: training, resume, exports, finetune and offline acceptance, on the real SmolLM2 data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import failure_text, last_json, run_stage, speculate_metadata

TRAIN = {"epochs": 6, "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128, "rows_per_batch": 2, "warmup_ratio": 0.0}


def _cfg(**kw):
    return {"eagle3_drafter": {"config": {**TRAIN, **kw}}}


@pytest.fixture(scope="module")
def trained(built):
    built.materialize("eagle3_drafter", config=_cfg(run_name="base"))
    built.materialize("drafter_export", "offline_acceptance",
                      config={"offline_acceptance": {"config": {"limit": 3, "max_new_tokens": 24}}})
    return built


def test_training_lowers_the_loss_and_raises_position0_accuracy(trained):
    meta = trained.latest("eagle3_drafter")
    assert meta["init"] == "scratch" and meta["epochs"] == 6 and meta["ttt_steps"] == 3
    assert meta["probe_loss_0_after"] < meta["probe_loss_0_before"]
    assert meta["probe_acc_0_after"] > meta["probe_acc_0_before"]
    assert {f"acc_{i}" for i in range(3)} | {f"loss_{i}" for i in range(3)} <= set(meta)
    assert meta["tokens_per_s"] > 0 and meta["simulated_acceptance_length"] >= 1.0


def test_the_training_curve_is_recorded_and_drawn(trained):
    meta = trained.latest("eagle3_drafter")
    curve = meta["training_curve"]
    assert curve["step"] == sorted(curve["step"]) and curve["step"][-1] <= meta["steps"]
    assert len(curve["step"]) == len(curve["loss_0"]) == len(curve["acc_0"]) >= 2
    assert curve["loss_0"][-1] < curve["loss_0"][0]  # it learns
    chart = meta["training_curve_chart"]
    assert chart.startswith("```") and "loss (unroll step 0)" in chart
    assert f"first {curve['loss_0'][0]:.4g}, last {curve['loss_0'][-1]:.4g}" in chart


def test_drafter_data_version_is_the_hash_of_its_weights(trained):
    from eagle3_assets.worker.training.checkpoint import weights_hash

    assert trained.data_version("eagle3_drafter") == weights_hash(Path(trained.latest("eagle3_drafter")["path"]))


def _worker(workdir: Path, stage: str, args: dict, **kw):
    cmd = [sys.executable, "-m", "eagle3_assets.worker", stage, "--workdir", str(workdir), "--args", json.dumps(args)]
    return cmd, {**os.environ, "EAGLE3_NO_BAR": "1"}


def test_resume_after_a_kill_ends_with_identical_weights(trained):
    target = trained.latest("target_model")["path"]
    shards = [f"hidden_states/shard-{k}" for k in ("00000", "00001")]
    base = {"target": target, "shards": shards, "vocab": "vocab/vocab_mapping.safetensors", "epochs": 2, "lr": 3e-3,
            "ttt_steps": 2, "row_tokens": 48, "rows_per_batch": 1, "save_every_steps": 1}
    assert run_stage(trained.workdir, "train", {**base, "out": "drafter/straight"}).returncode == 0

    cmd, env = _worker(trained.workdir, "train", {**base, "out": "drafter/interrupted"})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = trained.workdir / "drafter/interrupted/checkpoints/latest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (latest.exists() and json.loads(latest.read_text())["step"] >= 2):
        assert proc.poll() is None, "training finished before it could be interrupted"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (trained.workdir / "drafter/interrupted/model").exists()
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step-" in resumed.stderr
    a = load_file(str(trained.workdir / "drafter/straight/model/model.safetensors"))
    b = load_file(str(trained.workdir / "drafter/interrupted/model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_recipe_options_frozen_head_all_tokens_and_heldout_acceptance(trained):
    """The recipe's switches do what they say, and held-out acceptance is measured per epoch."""
    from eagle3_assets.worker.target.head import load_target_head, load_target_layer
    from eagle3_assets.worker.target.model import load_config, text_config

    target = trained.latest("target_model")["path"]
    args = {"target": target, "shards": ["hidden_states/shard-00000"], "eval_shards": ["hidden_states/shard-00001"],
            "vocab": "vocab/vocab_mapping.safetensors", "epochs": 2, "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128,
            "rows_per_batch": 2, "train_lm_head": False, "loss_on": "all", "out": "drafter/frozen", "resume": False,
            "noise_std": 0.2, "aux_scale": "rms", "init_layer": -1, "layer_lr": 0.0, "tracker": "tensorboard"}
    done = run_stage(trained.workdir, "train", args)
    assert done.returncode == 0, done.stderr
    meta = json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
    hp = meta["hyperparameters"]
    assert hp["train_lm_head"] is False and hp["loss_on"] == "all" and hp["noise_std"] == 0.2 and hp["init_layer"] == -1
    assert "draft layer initialised from target layer 29" in done.stderr
    # frozen: the draft lm_head is still exactly the target's rows of the draft vocab (the final norm, which
    # started as the target's, trains)
    w = load_file(str(trained.workdir / "drafter/frozen/model/model.safetensors"))
    head = load_target_head(Path(target), text_config(load_config(Path(target))).rms_norm_eps)
    rows = torch.arange(w["d2t"].shape[0]) + w["d2t"]
    assert torch.equal(w["lm_head.weight"].float(), head.lm_head[rows].float())
    assert not torch.equal(w["norm.weight"].float(), head.norm_weight.float())
    assert torch.allclose(w["norm.weight"].float(), head.norm_weight.float(), rtol=0.1)
    assert not torch.equal(w["fc.weight"], torch.zeros_like(w["fc.weight"]))
    # layer_lr 0: the decoder layer keeps the target layer's weights while fc and the norm train
    layer29 = load_target_layer(Path(target), 29)
    assert torch.equal(w["midlayer.mlp.down_proj.weight"], layer29["mlp.down_proj.weight"].float())
    assert hp["layer_lr"] == 0.0
    # held out: one figure per epoch, chain acceptance can only shrink along the chain
    assert meta["heldout_curve"]["epoch"] == [1, 2]
    accept = [meta[f"heldout_accept_{i}"] for i in range(3)]
    assert 1 >= accept[0] >= accept[1] >= accept[2] >= 0
    assert meta["heldout_acceptance_length_k3"] == pytest.approx(1 + sum(accept), abs=1e-3)
    # the benchmarks' entry point recomputes it from the saved weights, and on each reply's first tokens only
    from eagle3_assets.worker.training.evaluate import heldout_acceptance

    drafter, held = trained.workdir / "drafter/frozen/model", [trained.workdir / "hidden_states/shard-00001"]
    again = heldout_acceptance(Path(target), drafter, held)
    assert again["acceptance_length"] == pytest.approx(meta["heldout_acceptance_length_k3"], abs=1e-3)
    first = heldout_acceptance(Path(target), drafter, held, first_tokens=4)
    assert 1 <= first["acceptance_length"] <= 4  # (it raised a TypeError once the reader took `stored`)
    # the same run's curves in TensorBoard: every step's loss, per epoch the held-out figure, at the end the final
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained.workdir / "drafter/frozen/tensorboard")).Reload()
    loss = events.Scalars("train/loss_0")
    assert [e.step for e in loss] == list(range(1, meta["steps"] + 1))
    assert {"train/acc_2", "train/lr"} <= set(events.Tags()["scalars"])
    held = events.Scalars("heldout/acceptance_length_k3")
    assert len(held) == 2 and held[-1].value == pytest.approx(meta["heldout_curve"]["acceptance_length"][-1], abs=1e-4)
    assert events.Scalars("final/simulated_acceptance_length")[0].value == \
        pytest.approx(meta["simulated_acceptance_length"], abs=1e-4)


def test_the_training_scale_of_fc_inputs_is_folded_into_the_saved_fc():
    """aux_scale is a training-only reparametrization: a drafter loaded from the saved weights (plain fc, as the
    engines run it) computes exactly what the trained one did."""
    from eagle3_assets.worker.training.drafter import DraftConfig, Eagle3Drafter, init_weights

    c = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, vocab_size=100,
                    draft_vocab_size=50, target_hidden_size=32, aux_layer_ids=[1, 2, 3])
    torch.manual_seed(0)
    trained = Eagle3Drafter(c, torch.randn(100, 32))
    init_weights(trained)
    trained.aux_scale.copy_(torch.rand(96) * 10)
    served = Eagle3Drafter(c, torch.randn(100, 32))
    state = trained.export_state()
    assert "aux_scale" not in state
    served.load_state_dict(state, strict=False)
    aux = torch.randn(2, 5, 96)
    assert torch.allclose(trained.combine(aux), served.combine(aux), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(trained.fc(aux), served.fc(aux))  # the fold did something


def test_cached_target_labels_give_the_same_loss_as_the_full_head(trained):
    """Training reads the target's greedy labels from a cache and computes only the draft vocab's logits;
    the loss and accuracies must equal those of the full-vocab computation."""
    from eagle3_assets.worker.target.head import load_target_head
    from eagle3_assets.worker.target.model import load_config, text_config
    from eagle3_assets.worker.training.checkpoint import load_drafter_dir
    from eagle3_assets.worker.training.data import ShardSet, plan_batches
    from eagle3_assets.worker.training.drafter import Eagle3Drafter
    from eagle3_assets.worker.training.evaluate import batch_on, target_labels
    from eagle3_assets.worker.training.ttt_loss import draft_index, ttt_loss

    target = Path(trained.latest("target_model")["path"])
    tc = text_config(load_config(target))
    cfg, weights = load_drafter_dir(Path(trained.latest("eagle3_drafter")["path"]), tc)
    head = load_target_head(target, tc.rms_norm_eps)
    model = Eagle3Drafter(cfg, head.embed.float())
    model.load_state_dict(weights, strict=False)
    data = ShardSet([trained.workdir / "hidden_states/shard-00000"], tc.hidden_size)
    d2t_ids, to_draft = draft_index(model)
    head.float().restrict(d2t_ids)
    labels = target_labels(data, head, to_draft, "cpu", torch.float32, chunk_tokens=50)
    rows = plan_batches([r.length for r in data.refs], 0, 0, 128, 2)[0]
    with torch.no_grad():
        cached = ttt_loss(model, head, batch_on(data, rows, 128, "cpu", labels), 3, 0.8, torch.float32)
        full = ttt_loss(model, head, batch_on(data, rows, 128, "cpu"), 3, 0.8, torch.float32)
    assert torch.allclose(cached[0], full[0], rtol=1e-5)
    assert [float(a) for a in cached[2]] == [float(a) for a in full[2]] and cached[4] == full[4]
    assert float(full[2][0]) > 0  # a trained drafter: the comparison is not between zeros


def test_exports_meet_each_engines_contract(trained):
    meta = trained.latest("drafter_export")
    assert meta["validated"] is True
    for dialect in ("vllm", "sglang"):
        d = Path(meta[f"{dialect}_path"])
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
        assert cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 576
        assert cfg["max_position_embeddings"] >= 8192
        # trained on the default layers: no ids, so both engines capture exactly those
        assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg
        t = load_file(str(d / "model.safetensors"))
        assert not any("embed_tokens" in k for k in t)
        assert t["fc.weight"].shape == (576, 3 * 576) and t["fc.weight"].dtype == torch.bfloat16
        assert t["midlayer.self_attn.q_proj.weight"].shape == (9 * 64, 2 * 576)
        assert t["lm_head.weight"].shape == (64, 576) and t["d2t"].dtype == torch.int64 and t["t2d"].shape == (49152,)


def test_non_default_layers_are_written_in_each_engines_convention(trained, tmp_path):
    from transformers import AutoConfig

    from eagle3_assets.worker.serving.export import engine_capture_layers, write_export

    src = tmp_path / "custom"
    shutil.copytree(trained.latest("eagle3_drafter")["path"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["eagle3_assets"]["aux_layer_ids"] = [2, 10, 20]
    (src / "config.json").write_text(json.dumps(cfg))
    tc = AutoConfig.from_pretrained(trained.latest("target_model")["path"])
    write_export(src, tmp_path / "vllm", "vllm", tc)
    write_export(src, tmp_path / "sglang", "sglang", tc)
    v = json.loads((tmp_path / "vllm/config.json").read_text())
    s = json.loads((tmp_path / "sglang/config.json").read_text())
    assert v["eagle_aux_hidden_state_layer_ids"] == [3, 11, 21]  # vLLM: capture before layer i
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 10, 20]  # SGLang: output of layer, +1 inside
    assert engine_capture_layers("vllm", v, 30) == engine_capture_layers("sglang", s, 30) == [2, 10, 20]


def test_export_validation_names_the_offending_field(trained, tmp_path):
    from transformers import AutoConfig

    from eagle3_assets.worker.errors import StageError
    from eagle3_assets.worker.serving.export import validate_export

    tc = AutoConfig.from_pretrained(trained.latest("target_model")["path"])
    d = tmp_path / "v"
    shutil.copytree(trained.latest("drafter_export")["vllm_path"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    with pytest.raises(StageError, match="max_position_embeddings"):
        validate_export(d, "vllm", tc, [1, 14, 26])
    (d / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [1, 14, 26]}))
    with pytest.raises(StageError, match=r"capture target layers \[0, 13, 25\]"):
        validate_export(d, "vllm", tc, [1, 14, 26])


def test_the_exports_config_is_compared_with_the_checkpoints_key_by_key(trained, tmp_path):
    """What the integration gate names when an export's config makes another drafter: only the fields that differ,
    each with both values; what the exporter changes by design (dtype, the layer-id fields) is no difference."""
    from transformers import AutoConfig

    from eagle3_assets.worker.serving.export import compare_config

    tc = AutoConfig.from_pretrained(trained.latest("target_model")["path"])
    source = Path(trained.latest("drafter_export")["source"])
    d = tmp_path / "v"
    shutil.copytree(trained.latest("drafter_export")["vllm_path"], d)
    assert compare_config(d, source, "vllm", tc) == []
    cfg, trained_cfg = json.loads((d / "config.json").read_text()), json.loads((source / "config.json").read_text())
    theta, ours = trained_cfg["rope_theta"], trained_cfg["eagle3_assets"]["aux_layer_ids"]
    # a rotary base changed, and our ids written as they are into vLLM's capture-before field
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": theta * 10, "eagle_aux_hidden_state_layer_ids": ours}))
    assert compare_config(d, source, "vllm", tc) == [
        {"key": "rope_theta", "export": theta * 10, "checkpoint": theta},
        {"key": "aux layers (vllm captures, output of layer i)", "export": [i - 1 for i in ours], "checkpoint": ours}]


def test_offline_acceptance_reports_engine_comparable_figures(trained):
    meta = trained.latest("offline_acceptance")
    assert meta["output_matches_target_greedy"] is True
    k = meta["num_speculative_tokens"]
    assert 1.0 <= meta["acceptance_length"] <= k + 1
    # acceptance length = accepted + 1 per verify step = 1 + sum of per-position acceptance
    per_pos = [meta[f"acceptance_at_pos_{i}"] for i in range(k)]
    assert meta["acceptance_length"] == pytest.approx(1 + sum(per_pos), abs=1e-3)
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert meta["prompts"] == 3 and meta["verify_steps"] > 0


@pytest.mark.slow  # the draft-verify loop, prompt by prompt: 26 s
def test_replay_gives_the_decode_loops_figures(trained):
    """Offline acceptance by replay (the target's greedy outputs generated in batches, each verify step replayed
    on its hidden states) counts exactly what the draft-verify loop counts, step by step, on the training
    prompts."""
    common = {"prompts": "prompts/train.parquet", "limit": 4, "max_new_tokens": 24}
    figures = {}
    for name, extra in {"decode": {"method": "decode"}, "replay": {"method": "replay", "batch_size": 1},
                        "replay-batched": {"method": "replay", "batch_size": 4}}.items():
        meta = speculate_metadata(trained, **common, **extra)
        assert meta["output_matches_target_greedy"] is True and meta["method"] == extra["method"], meta
        # the figures at k (replay measures every shorter k too, decode k alone)
        figures[name] = {k: v for k, v in meta.items() if (k.startswith("accept") and "_k" not in k)
                         or k in ("verify_steps", "generated_tokens")}
    assert figures["decode"]["acceptance_at_pos_1"] > 0, figures  # steps of several drafts: the case worth checking
    assert figures["replay"] == figures["decode"], figures
    assert figures["replay-batched"] == figures["decode"], figures


def test_finetune_from_a_saved_export_continues_from_its_weights(trained, tmp_path):
    base = trained.latest("eagle3_drafter")
    export = trained.latest("drafter_export")["vllm_path"]
    # the speculators / vLLM naming (layers.0.*) must load as well
    d = tmp_path / "renamed"
    d.mkdir()
    t = load_file(str(Path(export) / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in t.items()}, str(d / "model.safetensors"))
    shutil.copy(Path(export) / "config.json", d / "config.json")
    trained.materialize("eagle3_drafter", config=_cfg(run_name="ft", init_from=str(d), epochs=1, lr=1e-4))
    meta = trained.latest("eagle3_drafter")
    assert meta["init"] == "finetune" and meta["init_from"] == str(d)
    assert meta["draft_vocab_size"] == 64 and "reused" in meta["draft_vocab_source"]
    # it starts where the base run ended (up to the export's bf16 rounding), far from a fresh start
    assert meta["probe_loss_0_before"] == pytest.approx(base["probe_loss_0_after"], rel=0.02)
    trained.materialize("eagle3_drafter", config=_cfg(run_name="base"))  # restore (resumes: nothing to do)


def _corrupt(src: str, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name,edit,expect", [
    ("missing", lambda t: t.pop("norm.weight"), "tensor 'norm.weight' is missing"),
    ("shape", lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :576].contiguous()),
     r"tensor 'fc.weight' has shape \[576, 576\], expected \[576, 1728\]"),
])
def test_bad_checkpoint_fails_naming_the_tensor(trained, tmp_path, name, edit, expect):
    import re

    bad = _corrupt(trained.latest("drafter_export")["vllm_path"], tmp_path / name, edit)
    res = trained.materialize("eagle3_drafter", config=_cfg(run_name=f"bad-{name}", init_from=str(bad)),
                              raise_on_error=False)
    assert not res.success and re.search(expect, failure_text(res))


def test_vocab_mapping_for_another_target_is_rejected(trained, tmp_path):
    target = trained.latest("target_model")["path"]
    d2t = torch.zeros(16, dtype=torch.long)
    t2d = torch.zeros(32000, dtype=torch.bool)
    t2d[:16] = True
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vocab.safetensors"))
    done = run_stage(trained.workdir, "train", {"target": target, "shards": ["hidden_states/shard-00000"],
                                                "vocab": str(tmp_path / "vocab.safetensors"), "out": str(tmp_path / "o")})
    assert done.returncode == 2 and "t2d covers 32000 target ids but the target vocab has 49152" in done.stderr


def test_hidden_states_of_the_wrong_width_are_rejected(trained, tmp_path):
    target = trained.latest("target_model")["path"]
    shard = tmp_path / "shard-00000"
    shutil.copytree(trained.workdir / "hidden_states/shard-00000", shard)
    m = json.loads((shard / "manifest.json").read_text())
    part = shard / m["files"][0]["name"]
    t = load_file(str(part))
    t["aux"] = t["aux"][:, :1000].contiguous()  # a 3*H that no longer matches the target
    save_file(t, str(part))
    m["files"][0]["bytes"] = part.stat().st_size
    (shard / "manifest.json").write_text(json.dumps(m))
    args = {"target": target, "shards": [str(shard)], "vocab": "vocab/vocab_mapping.safetensors",
            "out": str(tmp_path / "o")}
    done = run_stage(trained.workdir, "train", args)
    assert done.returncode == 2
    assert "tensor 'aux' has shape" in done.stderr and "expected" in done.stderr and "[" in done.stderr
    m["hidden_size"] = 4096
    (shard / "manifest.json").write_text(json.dumps(m))
    done = run_stage(trained.workdir, "train", args)
    assert "4096-wide" in done.stderr and "hidden size is 576" in done.stderr


@pytest.mark.slow  # three training processes (one alone, then a 2-rank gloo group): ~22 s of CPU
def test_data_parallel_training_splits_each_step_across_processes(trained, tmp_path):
    """Two processes (gloo on CPU; NCCL on GPUs) share each optimizer step: half the steps, one model."""
    target = trained.latest("target_model")["path"]
    args = {"target": target, "shards": ["hidden_states/shard-00000", "hidden_states/shard-00001"],
            "vocab": "vocab/vocab_mapping.safetensors", "epochs": 1, "ttt_steps": 2, "row_tokens": 48,
            "rows_per_batch": 1}
    single, env = _worker(trained.workdir, "train", {**args, "out": str(tmp_path / "one")})
    one = subprocess.run(single, env=env, capture_output=True, text=True)
    dp, env = _worker(trained.workdir, "train", {**args, "out": str(tmp_path / "two"), "num_processes": 2})
    two = subprocess.run(dp, env=env, capture_output=True, text=True)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    r1, r2 = last_json(one.stdout), last_json(two.stdout)
    assert r2["data_parallel_processes"] == 2 and r2["steps"] == -(-r1["steps"] // 2)
    w = load_file(str(tmp_path / "two/model/model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values() if t.is_floating_point())


def test_the_greedy_check_finds_the_first_token_the_target_would_not_choose(trained):
    """Offline acceptance checks losslessness by one teacher-forced pass: it must agree with token-by-token
    greedy generation, and name the first token a broken speculator let through."""
    import torch

    from eagle3_assets.worker.serving.speculate import first_non_greedy
    from eagle3_assets.worker.target.model import load_model

    target = load_model(Path(trained.latest("target_model")["path"]), "float32", "cpu")
    prompt = [1, 504, 3458, 314, 260, 1789, 28]
    with torch.inference_mode():
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert first_non_greedy(target, prompt, greedy, 1e-3) is None
    i = min(5, len(greedy) - 1)
    wrong = greedy[:i] + [(greedy[i] + 1) % target.config.vocab_size] + greedy[i + 1:]
    assert first_non_greedy(target, prompt, wrong, 1e-3) == i


def test_an_online_drafter_needs_no_shard_writes_none_and_goes_down_the_graph_as_any(trained):
    """Last in this file: it leaves the newest drafter an online one. `hidden_states: online` trains on the target's
    states computed as it trains, from the conversations (the stage's equality with offline training:
    test_online.py); the asset brings the conversations, not the shards, and the export and offline_acceptance
    downstream take the checkpoint as they take any."""
    trained.materialize("eagle3_drafter", config=_cfg(run_name="online", hidden_states="online", epochs=1))
    meta = trained.latest("eagle3_drafter")
    assert meta["hidden_states"] == "online" and meta["hidden_state_bytes_written"] == 0
    assert meta["hidden_states_source"].startswith("online, from conversations"), meta["hidden_states_source"]
    assert meta["offline_shards_bytes_fp8"] > 0 and meta["tokens_per_s"] > 0
    trained.materialize("drafter_export", "offline_acceptance",
                        config={"offline_acceptance": {"config": {"limit": 3, "max_new_tokens": 24}}})
    assert trained.latest("offline_acceptance")["acceptance_length"] >= 1.0
