"""A DeepSeek-V3-family target must name its router as transformers computes it: transformers always routes by
sigmoid scores with the correction bias (noaux_tc), vLLM and SGLang by what the config says (absent: softmax).
bench/moe_agreement.py measures what a config without the keys does to the two backends' shards."""

from __future__ import annotations

import pytest
from transformers import DeepseekV3Config, LlamaConfig

from eagle3_assets.worker.errors import StageError
from eagle3_assets.worker.target.moe_routing import check_router_config, routing


def _deepseek(**keys):
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, num_hidden_layers=3, n_routed_experts=8,
                           num_experts_per_tok=2, n_group=4, topk_group=2)
    for k, v in keys.items():
        setattr(cfg, k, v)
    return cfg


def test_a_config_written_by_transformers_is_refused_naming_the_keys_and_values_to_add():
    with pytest.raises(StageError) as e:
        check_router_config("tiny-v3", _deepseek())  # DeepseekV3Config writes neither key
    msg = str(e.value)
    for words in ("tiny-v3", "scoring_func=None", "topk_method=None", '"scoring_func": "sigmoid"',
                  '"topk_method": "noaux_tc"', "softmax"):
        assert words in msg, (words, msg)
    with pytest.raises(StageError, match="scoring_func='softmax'"):
        check_router_config("v3", _deepseek(scoring_func="softmax", topk_method="noaux_tc"))


def test_deepseek_and_moonshot_configs_pass_and_the_router_is_described():
    cfg = _deepseek(scoring_func="sigmoid", topk_method="noaux_tc")
    check_router_config("v3", cfg)
    cfg.model_type = "kimi_k2"  # Kimi K2's text model: the same router in transformers
    check_router_config("k2", cfg)
    assert routing(cfg) == {"experts": 8, "experts_per_token": 2, "groups": 4, "groups_per_token": 2,
                            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    dense = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3)
    check_router_config("llama", dense)
    assert routing(dense) is None
