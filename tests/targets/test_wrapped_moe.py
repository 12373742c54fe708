"""The story's class of target through the hf-backend graph: a Kimi-K2.5-style wrapper (`kimi_k25` around a
DeepSeek-V3 text model: MLA attention, MoE layers, Kimi's 163,840-token vocab, tensors under
`language_model.*`), tiny and random (tests/tiny_targets.py), from target_model to both exports; then
finetuning an existing drafter whose layer ids are written in each engine's convention."""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import Graph, hidden_states, last_json, run_stage
from tiny_targets import KIMI_VOCAB, save_kimi_k25_like

TRAIN = {"epochs": 2, "lr": 3e-3, "ttt_steps": 2, "row_tokens": 128, "rows_per_batch": 2, "warmup_ratio": 0.0,
         "precision": "fp32"}
DRAFT_VOCAB = 256


def _config(target: Path, **train) -> dict:
    return {
        "target_model": {"config": {"path": str(target)}},
        "prompts": {"config": {"max_train_conversations": 6}},
        "synthetic_prompts": {"config": {"count": 0}},
        "conversations": {"config": {"max_new_tokens": 12, "samples_per_shard": 3, "batch_size": 6,
                                     "dtype": "float32"}},
        "hidden_state_shards": {"config": {"dtype": "float32", "batch_tokens": 256}},
        "vocab_mapping": {"config": {"draft_vocab_size": DRAFT_VOCAB}},
        "eagle3_drafter": {"config": {**TRAIN, **train}},
    }


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return save_kimi_k25_like(tmp_path_factory.mktemp("targets") / "tiny-kimi-k25")


@contextlib.contextmanager
def default_graph(target: Path, tmp_path_factory, name: str):
    """Its own instance and host work directory (the session's hold the SmolLM2 graph): every asset from
    target_model to drafter_export with default settings but the tiny recipe, each shard partition in its own
    run."""
    with dg.DagsterInstance.local_temp(str(tmp_path_factory.mktemp(f"{name}_dagster_home"))) as instance:
        g = Graph(instance, tmp_path_factory.mktemp(f"{name}_host_work"))
        cfg = _config(target)
        g.materialize("target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping", config=cfg)
        for key in instance.get_dynamic_partitions("hidden_state_shards"):
            g.materialize("hidden_state_shards", partition=key, config=cfg)
        g.materialize("eagle3_drafter", config=cfg)
        g.materialize("drafter_export", config=cfg)
        yield g


@pytest.fixture(scope="module")
def pipeline(kimi, tmp_path_factory):
    with default_graph(kimi.path, tmp_path_factory, "kimi") as g:
        yield g


def _text_config(path: Path):
    from eagle3_assets.worker.target.model import load_config, text_config

    return text_config(load_config(path))


def test_target_model_describes_the_text_model(pipeline, kimi, tmp_path):
    meta = pipeline.latest("target_model")
    top = json.loads((kimi.path / "config.json").read_text())
    text = top["text_config"]
    assert meta["architecture"] == "KimiK25ForConditionalGeneration" and meta["model_type"] == "kimi_k25"
    assert meta["text_model_type"] == text["model_type"] == "kimi_k2"
    assert (meta["num_layers"], meta["hidden_size"], meta["vocab_size"]) == (
        text["num_hidden_layers"], text["hidden_size"], text["vocab_size"])
    assert "num_hidden_layers" not in top and meta["vocab_size"] == KIMI_VOCAB
    # by hand on the host, the stage says the same
    done = run_stage(tmp_path, "prepare_target", {"path": str(kimi.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert {k: v for k, v in last_json(done.stdout).items() if k != "weights_sha256"} == \
        {k: v for k, v in meta.items() if k != "weights_sha256"}


def test_shards_hold_the_text_models_hidden_states(pipeline, kimi):
    """Against an independent reference: transformers' own Kimi-K2.5 class (vision tower and all) loading
    the directory, its forward's hidden states at the manifest's layers."""
    from transformers import Kimi_K25ForConditionalGeneration

    from eagle3_assets.common.shard_format import default_aux_layers

    ref, info = Kimi_K25ForConditionalGeneration.from_pretrained(kimi.path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # a whole model, nothing random
    ref.eval()
    tc = kimi.text_config
    conv = pq.read_table(pipeline.workdir / "conversations/conversations.parquet").to_pylist()
    keys = pipeline.instance.get_dynamic_partitions("hidden_state_shards")
    assert len(keys) == 2
    seen = 0
    for key in keys:
        shard = pipeline.workdir / f"hidden_states/shard-{key}"
        manifest = json.loads((shard / "manifest.json").read_text())
        assert manifest["hidden_size"] == tc.hidden_size and manifest["num_layers"] == tc.num_hidden_layers
        aux_ids = manifest["aux_layer_ids"]
        assert aux_ids == default_aux_layers(tc.num_hidden_layers) and len(set(aux_ids)) == 3
        assert manifest["layer_convention"] == "output_of_layer"
        least = 0.999 if manifest["storage"] == "fp8" else 0.9999  # fp8: ~1/16 relative per value, at most
        for row in pq.read_table(shard / "index.parquet").to_pylist():
            part = hidden_states(load_file(str(shard / row["part"])))  # fp8 (v2, the default) dequantized
            sl = slice(row["offset"], row["offset"] + row["length"])
            ids = conv[row["row"]]["input_ids"]
            assert part["input_ids"][sl].tolist() == ids
            with torch.no_grad():
                hs = ref(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            assert len(hs) == tc.num_hidden_layers + 1
            got = part["aux"][sl].view(len(ids), 3, tc.hidden_size)
            for j, i in enumerate(aux_ids):  # output of layer i = HF hidden_states[i + 1]
                cos = torch.nn.functional.cosine_similarity(got[:, j], hs[i + 1][0], dim=-1)
                assert cos.min() >= least, (i, cos.min())
            # `final` is pre-norm: the text model's own final norm turns it into HF's last hidden state
            with torch.no_grad():
                normed = ref.model.language_model.norm(part["final"][sl])
            assert torch.nn.functional.cosine_similarity(normed, hs[-1][0], dim=-1).min() >= least
            seen += 1
    assert seen == 6
    # the layers differ from each other: the comparison above could tell a wrong layer
    assert not torch.allclose(hs[aux_ids[0] + 1], hs[aux_ids[1] + 1], atol=1e-3)


def test_the_draft_layer_is_shaped_for_an_mla_target_and_trains(pipeline, kimi):
    meta = pipeline.latest("eagle3_drafter")
    assert meta["init"] == "scratch" and meta["probe_loss_0_after"] < meta["probe_loss_0_before"]
    cfg = json.loads((Path(meta["path"]) / "config.json").read_text())
    tc = kimi.text_config
    # as SpecForge's and TorchSpec's Kimi-K2.5 drafts: every head for K/V, head_dim = the MLA v_head_dim
    # (7168 / 64 = 112 for Kimi, theirs is 128), the dense-layer intermediate size
    assert tc.v_head_dim != tc.hidden_size // tc.num_attention_heads
    assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == tc.num_attention_heads
    assert cfg["head_dim"] == tc.v_head_dim and cfg["intermediate_size"] == tc.intermediate_size
    assert cfg["vocab_size"] == KIMI_VOCAB and cfg["target_hidden_size"] == tc.hidden_size
    assert cfg["eagle3_assets"]["target"]["num_layers"] == tc.num_hidden_layers


def test_the_drafters_head_comes_from_the_language_models_tensors(pipeline, kimi):
    """At lr 1e-30 (0 is refused; an update that small is below float32's resolution, so the weights stay
    bit-identical) the saved drafter is its initialisation: lm_head = the target's `language_model.lm_head`
    rows of the draft vocab, final norm = `language_model.model.norm`; the MLA/MoE target layers cannot start
    the dense draft layer, which says so and starts at random."""
    workdir = pipeline.workdir
    args = {"target": str(kimi.path), "vocab": "vocab/vocab_mapping.safetensors", "out": "drafter/at-init",
            "shards": [f"hidden_states/shard-{k}" for k in pipeline.instance.get_dynamic_partitions("hidden_state_shards")],
            **TRAIN, "epochs": 1, "lr": 1e-30}
    done = run_stage(workdir, "train", args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "draft layers initialised at random" in done.stderr and "self_attn.q_proj.weight" in done.stderr
    w = load_file(str(workdir / "drafter/at-init/model/model.safetensors"))
    index = json.loads((kimi.path / "model.safetensors.index.json").read_text())["weight_map"]

    def target(name):
        with safe_open(str(kimi.path / index[name]), "pt") as st:
            return st.get_tensor(name)

    rows = torch.arange(w["d2t"].shape[0]) + w["d2t"]
    head = target("language_model.lm_head.weight")
    assert torch.equal(w["lm_head.weight"], head[rows]) and head[rows].abs().sum() > 0
    norm = target("language_model.model.norm.weight")
    assert torch.equal(w["norm.weight"], norm) and not torch.equal(norm, torch.ones_like(norm))
    assert w["t2d"].shape == (KIMI_VOCAB,) and int(rows.max()) < kimi.tokenizer_size


def test_exports_carry_the_text_models_vocab_width_and_default_layers(pipeline, kimi):
    meta = pipeline.latest("drafter_export")
    tc = kimi.text_config
    assert meta["validated"] is True
    for dialect in ("vllm", "sglang"):
        d = Path(meta[f"{dialect}_path"])
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["vocab_size"] == KIMI_VOCAB and cfg["target_hidden_size"] == tc.hidden_size
        assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["max_position_embeddings"] >= tc.max_position_embeddings
        # trained on the defaults for an 8-layer target: no ids, both engines capture exactly those
        assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg
        assert meta[f"{dialect}_layer_ids"] == "omitted (engine defaults)"
        t = load_file(str(d / "model.safetensors"))
        assert t["fc.weight"].shape == (tc.hidden_size, 3 * tc.hidden_size) and t["t2d"].shape == (KIMI_VOCAB,)
        assert t["midlayer.self_attn.q_proj.weight"].shape == (tc.num_attention_heads * tc.v_head_dim, 2 * tc.hidden_size)


def test_layer_ids_for_a_61_layer_target_in_each_dialect(pipeline, kimi, tmp_path):
    """Kimi-K2.5's 61 layers, read through the wrapper's text_config: the default ids [1, 29, 57] are
    omitted; others are written as each engine numbers them (vLLM: capture before layer i = ours + 1)."""
    from eagle3_assets.worker.serving.export import engine_capture_layers, validate_export, write_export
    from eagle3_assets.worker.target.model import load_config

    wrapper = copy.deepcopy(load_config(kimi.path))
    wrapper.text_config.num_hidden_layers = 61
    assert not hasattr(wrapper, "num_hidden_layers") or wrapper.num_hidden_layers != 61
    src = tmp_path / "drafter"
    shutil.copytree(pipeline.latest("eagle3_drafter")["path"], src)
    cfg = json.loads((src / "config.json").read_text())
    for ids, vllm_ids, sglang_ids in (([1, 29, 57], None, None), ([1, 30, 58], [2, 31, 59], [1, 30, 58])):
        cfg["eagle3_assets"]["aux_layer_ids"] = ids
        (src / "config.json").write_text(json.dumps(cfg))
        v, s = tmp_path / f"vllm-{ids[0]}", tmp_path / f"sglang-{ids[0]}"
        write_export(src, v, "vllm", wrapper)
        write_export(src, s, "sglang", wrapper)
        vc, sc = (json.loads((d / "config.json").read_text()) for d in (v, s))
        assert vc.get("eagle_aux_hidden_state_layer_ids") == vllm_ids and "eagle_config" not in vc
        assert (sc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") == sglang_ids
        assert "eagle_aux_hidden_state_layer_ids" not in sc
        assert engine_capture_layers("vllm", vc, 61) == engine_capture_layers("sglang", sc, 61) == ids
        assert validate_export(v, "vllm", wrapper, ids)["captured_layers"] == ids
        assert vc["vocab_size"] == KIMI_VOCAB and vc["target_hidden_size"] == kimi.text_config.hidden_size
    # SGLang's DeepSeek-family classes (Kimi's) take a list not starting at 1 as capture-before since sglang
    # PR #25454, and earlier releases add 1: no list of that kind means the same to both, so it is refused
    from eagle3_assets.worker.errors import StageError

    cfg["eagle3_assets"]["aux_layer_ids"] = [2, 30, 58]
    (src / "config.json").write_text(json.dumps(cfg))
    write_export(src, tmp_path / "vllm-2", "vllm", wrapper)
    assert json.loads((tmp_path / "vllm-2" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    with pytest.raises(StageError, match=r"PR #25454.*aux layers \[2, 30, 58\] would be misread"):
        write_export(src, tmp_path / "sglang-2", "sglang", wrapper)
    assert not (tmp_path / "sglang-2").exists()


def test_serving_reads_the_wrapped_targets_layer_count(pipeline, kimi):
    """serve_bench's wiring report reads the text model's layers (the top-level config has none)."""
    from eagle3_assets.worker.serving.bench import layer_wiring

    exp = Path(pipeline.latest("drafter_export")["vllm_path"])
    trained = Path(pipeline.latest("eagle3_drafter")["path"])
    wiring = layer_wiring("vllm", exp, trained, kimi.path)
    assert wiring["served_aux_layers"] == wiring["trained_aux_layers"] == pipeline.latest("eagle3_drafter")["aux_layer_ids"]


def test_target_model_records_the_router_and_refuses_one_transformers_would_route_otherwise(pipeline, kimi, tmp_path):
    """transformers routes DeepSeek-V3 / Kimi K2 experts by sigmoid + correction bias whatever the config says;
    vLLM follows `scoring_func` / `topk_method` (absent: softmax). A config without them (as transformers'
    DeepseekV3Config writes it) would give hf shards of another model than the engine serves."""
    text = json.loads((kimi.path / "config.json").read_text())["text_config"]
    assert pipeline.latest("target_model")["moe_routing"] == {
        "experts": text["n_routed_experts"], "experts_per_token": text["num_experts_per_tok"],
        "groups": text["n_group"], "groups_per_token": text["topk_group"], "scoring_func": "sigmoid",
        "topk_method": "noaux_tc"}
    bare = tmp_path / "kimi-no-router-keys"
    shutil.copytree(kimi.path, bare)
    top = json.loads((bare / "config.json").read_text())
    for key in ("scoring_func", "topk_method"):
        top["text_config"].pop(key)
    (bare / "config.json").write_text(json.dumps(top))
    done = run_stage(tmp_path, "prepare_target", {"path": str(bare)})
    assert done.returncode == 2, done.stderr[-3000:]
    for words in (str(bare), "scoring_func=None", "topk_method=None", '"scoring_func": "sigmoid"', "softmax"):
        assert words in done.stderr, (words, done.stderr[-2000:])


def test_a_wrapped_target_missing_a_text_tensor_is_refused_naming_it(pipeline, kimi, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad-kimi"
    shutil.copytree(kimi.path, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "language_model.model.layers.6.self_attn.kv_b_proj.weight"
    part = bad / index["weight_map"].pop(name)
    t = load_file(str(part))
    del t[name]
    save_file(t, str(part), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    done = run_stage(pipeline.workdir, "extract", {"target": str(bad), "conversations": "conversations/conversations.parquet",
                                                 "shard": 0, "samples_per_shard": 3, "out_dir": str(tmp_path / "hs"),
                                                 "dtype": "float32"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "model.layers.6.self_attn.kv_b_proj.weight" in done.stderr and str(bad) in done.stderr
    assert not (tmp_path / "hs/shard-00000").exists()


# ---- item 5: finetuning an existing drafter, its layer ids in its own convention ----

def _drafter_with_ids(src: Path, dst: Path, convention: str, ours: list[int]) -> Path:
    """A copy of a trained drafter whose config names `ours` (output-of-layer ids) the way `convention` does."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("eagle3_assets", None)
    if convention == "ours":
        cfg["eagle3_assets"] = {"aux_layer_ids": ours, "layer_convention": "output_of_layer"}
    elif convention == "specforge":  # SpecForge / SGLang: eagle_config, output of layer i
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ours, "use_aux_hidden_state": True}
    elif convention == "vllm":  # vLLM: top level, capture before layer i
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ours]
    elif convention == "speculators":  # speculators' own format: the layer under transformer_layer_config,
        from safetensors.torch import (
            save_file,  # tensors `layers.0.*`, an embedding saved along
        )

        w = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(src / "model.safetensors")).items()}
        w["embed_tokens.weight"] = torch.zeros(cfg["vocab_size"], cfg["hidden_size"])
        save_file(w, str(dst / "model.safetensors"))
        layer = {k: cfg.pop(k) for k in list(cfg) if k not in ("draft_vocab_size", "target_hidden_size")}
        layer["architectures"], layer["model_type"] = ["LlamaForCausalLM"], "llama"
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "norm_before_residual": False,
               "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ours], "transformer_layer_config": layer,
               "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": 3}], "verifier": {"name_or_path": "tiny-kimi-k25"}}, **cfg}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


CONVENTIONS = ("ours", "specforge", "vllm", "speculators")


def load_config_of(kimi):
    from eagle3_assets.worker.target.model import load_config

    return load_config(kimi.path)  # the wrapper's config: load_drafter_dir reads its text model


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_a_drafter_whose_ids_match_the_shards_is_accepted_in_any_convention(pipeline, kimi, tmp_path, convention):
    from eagle3_assets.worker.training.checkpoint import check_finetune_layers, load_drafter_dir, read_aux_ids

    shard_ids = pipeline.latest("eagle3_drafter")["aux_layer_ids"]
    src = Path(pipeline.latest("eagle3_drafter")["path"])
    d = _drafter_with_ids(src, tmp_path / convention, convention, shard_ids)
    c, w = load_drafter_dir(d, load_config_of(kimi))
    assert c.aux_layer_ids == shard_ids and c.head_dim == kimi.text_config.v_head_dim
    original = load_file(str(src / "model.safetensors"))
    assert w.keys() == original.keys() and all(torch.equal(w[k], original[k]) for k in w)
    written = json.loads((d / "config.json").read_text())
    check_finetune_layers(d, read_aux_ids(written, kimi.text_config.num_hidden_layers, "kimi_k2"), shard_ids,
                          kimi.text_config.num_hidden_layers)


@pytest.mark.parametrize("convention,off,written,spelled", [
    ("ours", [2, 4, 5], "[2, 4, 5] (its config's eagle3_assets.aux_layer_ids, ours: output of layer i)",
     "eagle3_assets.aux_layer_ids [1, 3, 4]"),
    # a list starting at 1: SGLang's DeepSeek-family class (this target's) reads it as output of layer i
    ("specforge", [1, 4, 5], ("[1, 4, 5] (its config's eagle_config.eagle_aux_hidden_state_layer_ids, SpecForge/SGLang: "
                              "output of layer i)"), "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 4]"),
    # a SpecForge-style list read as vLLM's: the classic off-by-one
    ("vllm", [0, 2, 3], ("[0, 2, 3] in our output-of-layer numbering (its config's eagle_aux_hidden_state_layer_ids "
                         "says [1, 3, 4], vLLM/speculators: capture before layer i)"),
     "eagle_aux_hidden_state_layer_ids [2, 4, 5]"),
])
def test_a_drafter_one_layer_off_is_refused_before_training(pipeline, kimi, tmp_path, convention, off, written, spelled):
    shard_ids = pipeline.latest("eagle3_drafter")["aux_layer_ids"]
    assert shard_ids == [1, 3, 4]  # the defaults of the 8-layer target (what the messages below spell out)
    d = _drafter_with_ids(Path(pipeline.latest("eagle3_drafter")["path"]), tmp_path / convention, convention, off)
    out = tmp_path / "finetuned"
    done = run_stage(pipeline.workdir, "train", {
        "target": str(kimi.path), "init_from": str(d), "out": str(out), **TRAIN,
        "shards": [f"hidden_states/shard-{k}" for k in pipeline.instance.get_dynamic_partitions("hidden_state_shards")]})
    assert done.returncode == 2, done.stderr[-3000:]
    msg = " ".join(done.stderr.split())
    assert f"was trained on target layers {written}" in msg
    assert "shards hold layers [1, 3, 4] (output of layer i)" in msg
    assert f"Rematerialize hidden_state_shards with aux_layers {off} (output of layer i)" in msg
    assert f"or pick a drafter trained on layers [1, 3, 4] (in this config's convention: {spelled})" in msg
    assert not out.exists() and "target labels" not in done.stderr  # stopped before any training work


def test_a_speculators_drafter_that_normalises_before_the_residual_is_refused(pipeline, kimi, tmp_path):
    from eagle3_assets.worker.errors import StageError
    from eagle3_assets.worker.training.checkpoint import load_drafter_dir

    shard_ids = pipeline.latest("eagle3_drafter")["aux_layer_ids"]
    d = _drafter_with_ids(Path(pipeline.latest("eagle3_drafter")["path"]), tmp_path / "spec", "speculators", shard_ids)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["norm_before_residual"]  # vLLM then serves it with norm_before_residual=True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StageError, match="norm_before_residual=True"):
        load_drafter_dir(d, load_config_of(kimi))


def test_specforges_kimi_k25_draft_ids_against_default_shards():
    """SpecForge ships configs/kimi-k25-eagle3.json with eagle_config ids [2, 30, 58]. For a Kimi (DeepSeek-
    family) target, SGLang takes a list not starting at 1 as capture-before (sglang PR #25454): [2, 30, 58]
    are the outputs of layers [1, 29, 57], the default shards' layers. Read as plain output-of-layer ids
    (as for a Llama target) they would be one layer off."""
    from eagle3_assets.common.shard_format import default_aux_layers
    from eagle3_assets.worker.errors import StageError
    from eagle3_assets.worker.training.checkpoint import check_finetune_layers, read_aux_ids

    spec = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    ids = read_aux_ids(spec, 61, "kimi_k2")
    assert ids.ours == [1, 29, 57] and "capture-before" in ids.convention
    check_finetune_layers(Path("kimi-k25-eagle3"), ids, default_aux_layers(61), 61)
    llama = read_aux_ids(spec, 61, "llama")  # SGLang's Llama adds 1 to every id: output of layer i
    assert llama.ours == [2, 30, 58]
    with pytest.raises(StageError, match=r"aux_layers \[2, 30, 58\]"):
        check_finetune_layers(Path("llama-eagle3"), llama, default_aux_layers(61), 61)
    # the same tensors in vLLM's numbering, and no ids at all (the engines' defaults), both match
    check_finetune_layers(Path("d"), read_aux_ids({"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}, 61), [1, 29, 57], 61)
    check_finetune_layers(Path("d"), read_aux_ids({}, 61), [1, 29, 57], 61)
    with pytest.raises(StageError, match="two different aux layer sets"):
        read_aux_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
                      "eagle_aux_hidden_state_layer_ids": [1, 29, 57]}, 61)


def test_finetuning_from_a_vllm_export_with_explicit_ids_continues_from_its_weights(pipeline, kimi, tmp_path):
    """Through the Dagster graph: a vLLM-convention drafter (top-level ids, capture-before) whose ids
    translate to the shards' layers finetunes, and starts where it ended."""
    base = pipeline.latest("eagle3_drafter")
    d = tmp_path / "vllm-explicit"
    shutil.copytree(pipeline.latest("drafter_export")["vllm_path"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in base["aux_layer_ids"]]
    (d / "config.json").write_text(json.dumps(cfg))
    pipeline.materialize("eagle3_drafter", config=_config(kimi.path, run_name="ft", init_from=str(d), epochs=1,
                                                          lr=1e-5))
    meta = pipeline.latest("eagle3_drafter")
    assert meta["init"] == "finetune" and meta["aux_layer_ids"] == base["aux_layer_ids"]
    assert meta["probe_loss_0_before"] == pytest.approx(base["probe_loss_0_after"], rel=0.02)
