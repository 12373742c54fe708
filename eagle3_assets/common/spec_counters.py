"""A serving engine's speculative-decoding counters, read from its Prometheus `/metrics` text and differenced
between two reads into acceptance figures. Standard library only: the benchmark (worker) reads its own servers
with it, the serving eye (control plane) reads production servers.

vLLM's definitions (`v1/spec_decode/metrics.py`): acceptance length = 1 + accepted / drafts (the bonus token
included), rate = accepted / drafted, position i = accepted at position i / drafts.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)(\s+[-0-9]+)?\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
VLLM_PREFIX = "vllm:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


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


def total(samples: dict, name: str, **match) -> float:
    """A metric summed over every label set that has the `match` labels (engines, models)."""
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == str(x) for k, x in match.items()))


def vllm_counters(text: str) -> dict:
    """vLLM's spec-decode counters as they stand: drafts, draft and accepted tokens, accepted per position."""
    samples = parse_prometheus(text)
    per_pos = {int(dict(labels)["position"]): v for (n, labels), v in samples.items()
               if n == f"{VLLM_PREFIX}num_accepted_tokens_per_pos" and "position" in dict(labels)}
    out = {c: total(samples, f"{VLLM_PREFIX}{c}") for c in COUNTERS}
    out["per_pos"] = [sum(v for p, v in per_pos.items() if p == i) for i in range(max(per_pos, default=-1) + 1)]
    out["present"] = any((n.startswith(VLLM_PREFIX)) for n, _ in samples)
    return out


def vllm_load(text: str) -> dict:
    """vLLM's load as it stands (`v1/metrics/loggers.py`): requests running and waiting now (gauges), output tokens
    generated, and the finished requests' summed end-to-end and queued seconds (counters, differenced by
    `load_between`)."""
    samples = parse_prometheus(text)
    return {"requests_running": total(samples, "vllm:num_requests_running"),
            "requests_waiting": total(samples, "vllm:num_requests_waiting"),
            "generation_tokens": total(samples, "vllm:generation_tokens"),
            "e2e_seconds": total(samples, "vllm:e2e_request_latency_seconds_sum"),
            "queued_seconds": total(samples, "vllm:request_queue_time_seconds_sum"),
            "finished": total(samples, "vllm:e2e_request_latency_seconds_count")}


def load_between(before: dict, after: dict, seconds: float) -> dict:
    """The load of a window between two reads: output tokens/s, and the mean batch (requests running at once, the
    size a speculation schedule is keyed by) by Little's law: the seconds the requests that finished in it spent
    running (end to end less queued), over its length; a gauge read once a window would miss every burst between
    reads. {} where the window has no length or the reads lack the counters."""
    if seconds <= 0 or any(k not in before or k not in after for k in ("generation_tokens", "e2e_seconds")):
        return {}
    made = int(after["generation_tokens"] - before["generation_tokens"])
    return {"generation_tokens": made, "generation_tokens_per_s": round(made / seconds, 2),
            "mean_requests_running": round(max(0.0, after["e2e_seconds"] - before["e2e_seconds"]
                                               - after.get("queued_seconds", 0) + before.get("queued_seconds", 0))
                                           / seconds, 3),
            "requests_finished": int(after.get("finished", 0) - before.get("finished", 0))}


def restarted(before: dict, after: dict) -> bool:
    """Counters only grow while a server lives: one that went back means the server started again."""
    return any(after.get(c, 0) < before.get(c, 0) for c in COUNTERS)


def window(before: dict | None, after: dict, k: int | None = None) -> dict:
    """Acceptance between two counter reads (`before` None or from an earlier life of the server: since its start);
    num_drafts 0 when no speculative step ran in between."""
    restart = before is not None and restarted(before, after)
    b = {} if before is None or restart else before
    drafts = after["num_drafts"] - b.get("num_drafts", 0)
    if drafts <= 0:
        return {"num_drafts": 0, "restarted": restart}
    accepted = after["num_accepted_tokens"] - b.get("num_accepted_tokens", 0)
    drafted = after["num_draft_tokens"] - b.get("num_draft_tokens", 0)
    positions = len(after.get("per_pos", [])) if k is None else k
    prev = b.get("per_pos", [])
    return {
        "num_drafts": int(drafts), "num_draft_tokens": int(drafted), "num_accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_per_pos": [((after["per_pos"][i] if i < len(after["per_pos"]) else 0.0)
                                - (prev[i] if i < len(prev) else 0.0)) / drafts for i in range(positions)],
        "restarted": restart,
    }


def acceptance_between(before: str, after: str, k: int) -> dict:
    """Acceptance between two vLLM /metrics scrapes of one server (the benchmark's measurement)."""
    out = window(vllm_counters(before), vllm_counters(after), k)
    out.pop("restarted")
    return out
