"""Targets of few layers: the aux layers a drafter reads must be three distinct layers of the target, chosen
for it when the user names none, and every refusal advises only what this target can run."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_stage
from eagle3_assets.common.shard_format import default_aux_layers, engine_default_aux_layers
from eagle3_assets.worker.errors import StageError
from eagle3_assets.worker.serving.export import layer_fields
from eagle3_assets.worker.shards.parts import check_aux_layers
from eagle3_assets.worker.training.checkpoint import AuxIds, check_finetune_layers, read_aux_ids
from tiny_targets import save_tiny_llama


def test_the_default_is_three_distinct_layers_of_every_target_of_three_or_more():
    for n in range(3, 200):
        ids = default_aux_layers(n)
        check_aux_layers(ids, n)  # raises unless 3 distinct ids in [0, n-1]
        if n >= 7:  # the engines' own defaults, so that an export needs no layer ids
            assert ids == engine_default_aux_layers(n), n
    assert default_aux_layers(61) == [1, 29, 57]  # Kimi-K2.5's, as the story's drafters were trained
    assert default_aux_layers(4) == [0, 2, 3] and len(set(engine_default_aux_layers(4))) < 3


def test_a_small_targets_export_names_its_layers_and_a_large_ones_need_not():
    """The engines would capture [1, 1, 0] for a 4-layer target: its export must say which layers, and SGLang,
    which never captures the last layer's output, refuses a default that holds it, naming that default."""
    assert layer_fields("vllm", default_aux_layers(4), 4, "llama")
    assert layer_fields("sglang", [0, 1, 2], 4, "llama")
    with pytest.raises(StageError, match=r"layer 3\) is never captured.*this target's default \[0, 2, 3\] is not"):
        layer_fields("sglang", default_aux_layers(4), 4, "llama")
    for engine in ("vllm", "sglang"):
        assert layer_fields(engine, default_aux_layers(32), 32, "llama") == {}, engine


def test_a_target_of_fewer_than_three_layers_is_refused_at_target_model(tmp_path):
    target = save_tiny_llama(tmp_path / "two-layers")
    done = run_stage(tmp_path, "prepare_target", {"path": str(target)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "has 2 decoder layer(s)" in done.stderr and "no choice of aux layers exists" in done.stderr


def test_the_finetune_refusal_advises_only_layers_the_target_has():
    # a drafter trained one layer higher than a 4-layer target's shards ([1, 2, 3]): layer 4 does not exist
    shifted = AuxIds([2, 3, 4])
    with pytest.raises(StageError) as e:
        check_finetune_layers(Path("shifted"), shifted, [1, 2, 3], 4)
    msg = str(e.value)
    assert "does not fit this target" in msg and "[4] outside it" in msg and "Rematerialize" not in msg, msg
    # one layer lower fits the target: rematerializing the shards on its layers is the advice
    with pytest.raises(StageError, match=r"Rematerialize hidden_state_shards with aux_layers \[0, 1, 2\]"):
        check_finetune_layers(Path("lower"), AuxIds([0, 1, 2]), [1, 2, 3], 4)
    # the layers a config with no ids names are the engines' defaults: for 4 layers, not distinct
    with pytest.raises(StageError, match="not 3 distinct layers"):
        check_finetune_layers(Path("no-ids"), read_aux_ids({}, 4), default_aux_layers(4), 4)
