"""SGLang: whether the installed version can serve EAGLE-3 for a target, its server command line, and its
accept length. SGLang cannot run on the machines this project is tested on: this module is held to
SGLang's documented flags and outputs (tests/test_engines.py checks both against the release we support).

SGLang reports the average accept length cumulatively since the server started (bonus token included, the
same definition as vLLM's acceptance length), so each measurement gets a fresh server."""

from __future__ import annotations

from . import support_probe

NAME = "sglang"
HEALTH = "/health"
SERVER_INFO = "/get_server_info"

# Run with the engine's Python. SGLang captures EAGLE-3's aux hidden states through the target class's
# `set_eagle3_layers_to_capture`; a target class without it cannot feed an EAGLE-3 draft.
SUPPORT_PROBE = support_probe("sglang", r'''
try:
    from sglang.srt.models.registry import ModelRegistry
    classes = ModelRegistry.models
    cls = classes.get(arch)
    if cls is None:
        reasons.append(f"it has no model class for the architecture {arch!r}")
    else:
        out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
        if not hasattr(cls, "set_eagle3_layers_to_capture"):
            reasons.append(f"its {cls.__qualname__} has no set_eagle3_layers_to_capture (the aux hidden-state "
                           f"capture EAGLE-3 needs)")
    if "LlamaForCausalLMEagle3" not in classes:
        reasons.append("it has no LlamaForCausalLMEagle3 draft model class")
except Exception as e:
    reasons.append(f"resolving the architecture failed: {type(e).__name__}: {e}")
''')


def server_command(python: str, target: str, port: int, *, drafter: str | None, k: int, dtype: str,
                   max_model_len: int, seed: int, extra: list[str]) -> list[str]:
    """`python -m sglang.launch_server`; with a drafter, chain drafting of k tokens (topk 1, k+1 tokens
    verified), the EAGLE3 algorithm: `EAGLE` with an EAGLE-3 draft loads and silently accepts nothing."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--context-length", str(max_model_len),
            "--random-seed", str(seed), "--enable-metrics",
            # the accept-length totals only grow every decode-log-interval steps (default 40): count every step
            "--decode-log-interval", "1"]
    if drafter:
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
    return argv + list(extra)


def accept_length(server_info: dict) -> float | None:
    """The average accept length from /get_server_info: `internal_states[0].avg_spec_accept_length`
    (older releases put it at the top level)."""
    states = server_info.get("internal_states") or []
    for where in (states[0] if states else {}, server_info):
        value = where.get("avg_spec_accept_length")
        if value is not None:
            return float(value)
    return None


# How SGLang (0.5.14, models/*.py `set_eagle3_layers_to_capture`) reads the export's
# `eagle_config.eagle_aux_hidden_state_layer_ids`: most model classes add 1 to every id (they capture a
# layer's input), so ids there are ours (output of layer i). deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2 and
# K2.5, whose kimi_k25.py hands over to it) and glm4_moe_lite.py add 1 only when the first id is 1, and
# take other lists as capture-before (sglang PR #25454); releases before it added 1 always. So for those
# targets only lists starting at layer 1 mean the same to every release.
FIRST_ID_RULE = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "glm4_moe_lite"})


def export_layer_ids(ours: list[int], model_type: str) -> list[int]:
    if model_type in FIRST_ID_RULE and ours[0] != 1:
        from ..errors import StageError

        raise StageError(f"SGLang reads EAGLE-3 layer ids for {model_type} targets two ways (releases since PR #25454 "
                         f"take a list whose first id is not 1 as capture-before, earlier ones add 1 to every id), so "
                         f"aux layers {list(ours)} would be misread by one of them: train on aux layers whose first id "
                         f"is 1 (the default [1, N//2-1, N-4] is), or export for vllm only (dialects: [vllm])")
    return list(ours)


def captured_layers(ids: list[int], model_type: str) -> list[int]:
    """The layers (ours) the current SGLang captures for these config ids."""
    if model_type in FIRST_ID_RULE and ids and ids[0] != 1:
        return [int(i) - 1 for i in ids]
    return list(ids)
