"""How a MoE target routes its tokens, and whether transformers and the serving engines read it alike.

transformers' DeepSeek-V3 router (also Kimi K2's text model, `kimi_k2`) always scores experts by sigmoid with
the score-correction bias and group-limited top-k (DeepSeek's `noaux_tc`), whatever the config says. vLLM
reads `scoring_func` and `topk_method` from the config and, when they are absent, scores by softmax without
the bias (SGLang reads the same keys). DeepSeek's and Moonshot's checkpoints write both keys; a config
written by transformers' `DeepseekV3Config` has neither. Then the hf backend extracts hidden states of
another model than the engine serves (bench/moe_agreement.py, a tiny Kimi-style target: without `scoring_func`,
10.9 % of the last layer's tokens below cosine 0.99 against 8.7 % with it), and without `topk_method` vLLM cannot even load the
checkpoint's correction bias.
"""

from __future__ import annotations

from ..errors import StageError

# text model types whose transformers router is sigmoid + noaux_tc regardless of the config
SIGMOID_NOAUX_TC = ("deepseek_v3", "kimi_k2")
EXPECTED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def routing(tc) -> dict | None:
    """The router's settings, for the target's metadata (None for a dense model)."""
    experts = getattr(tc, "n_routed_experts", None) or getattr(tc, "num_local_experts", None) \
        or getattr(tc, "num_experts", None)
    if not experts:
        return None
    return {"experts": int(experts), "experts_per_token": int(getattr(tc, "num_experts_per_tok", 0) or 0),
            "groups": int(getattr(tc, "n_group", 1) or 1), "groups_per_token": int(getattr(tc, "topk_group", 1) or 1),
            "scoring_func": getattr(tc, "scoring_func", None), "topk_method": getattr(tc, "topk_method", None)}


def check_router_config(path, tc) -> None:
    """Refuse a DeepSeek-V3-family text config that transformers and the engines would route differently."""
    if getattr(tc, "model_type", None) not in SIGMOID_NOAUX_TC or not getattr(tc, "n_routed_experts", None):
        return
    wrong = {k: getattr(tc, k, None) for k, v in EXPECTED.items() if getattr(tc, k, None) != v}
    if wrong:
        found = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        raise StageError(
            f"target {path}: its {tc.model_type} text config has {found}. transformers routes this model's "
            "experts by sigmoid scores with the correction bias (scoring_func 'sigmoid', topk_method 'noaux_tc') "
            "whatever the config says, while vLLM and SGLang follow these keys (absent: softmax without the bias), "
            "so the hf backend's hidden states would come from another model than the engine serves. DeepSeek-V3 "
            "and Kimi K2 checkpoints write both keys; add \"scoring_func\": \"sigmoid\" and \"topk_method\": "
            "\"noaux_tc\" to the text config if the model was trained that way (a config saved from transformers' "
            "DeepseekV3Config lacks them)")
