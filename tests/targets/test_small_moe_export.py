"""A 4-layer MoE target (the tiny Kimi-K2.5-style wrapper, 4 layers) through the default graph to its export.
Its default aux layers ([0, 2, 3]: the engines' own are not three distinct layers of it) include the last layer,
whose output SGLang never captures, and start at 0, which SGLang's DeepSeek-family classes read two ways: the
default export writes the dialect that serves the drafter as trained and records why it left the other out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_wrapped_moe import default_graph

from tiny_targets import save_kimi_k25_like


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    target = save_kimi_k25_like(tmp_path_factory.mktemp("targets") / "tiny-kimi-4-layers", layers=4)
    with default_graph(target.path, tmp_path_factory, "small_moe") as g:
        yield g, target


def test_the_default_graph_exports_what_serves_as_trained_and_says_what_it_left_out(small):
    from eagle3_assets.common.shard_format import default_aux_layers
    from eagle3_assets.worker.serving.export import validate_export
    from eagle3_assets.worker.target.model import load_config

    g, target = small
    trained = g.latest("eagle3_drafter")["aux_layer_ids"]
    assert trained == default_aux_layers(4)
    meta = g.latest("drafter_export")
    assert meta["dialects"] == "vllm" and "sglang_path" not in meta
    # the vLLM export names the layers and vLLM reads them back as trained
    vllm_dir = Path(meta["vllm_path"])
    ids = json.loads((vllm_dir / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    assert [i - 1 for i in ids] == trained
    assert validate_export(vllm_dir, "vllm", load_config(target.path), trained)["captured_layers"] == trained
    # why SGLang was left out: this target's real default, the layer it never captures, the first-id rule
    why = meta["sglang_left_out"]
    for words in (f"aux layers {trained} would be misread", "layer 3) is never captured", "PR #25454",
                  f"this target's default aux layers are {trained}", "dialects: [vllm]"):
        assert words in why, (words, why)
    assert "N//2-1" not in why
    # and the SGLang benchmark says so, before any host work
    done = g.materialize("serving_benchmark", partition="sglang", raise_on_error=False)
    failure = next(e for e in done.all_events if e.is_step_failure).step_failure_data.error.message
    assert "left out because" in failure and "never captured" in failure, failure
