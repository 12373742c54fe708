"""The load mix a production serves, and a drafter's speedup at it (shared by the control plane, which reads the
mix from the serving eye's observations, and the worker's serve_compare, which measures at it).

A mix is {concurrency: share of the output tokens made at that batch size}. Output-weighted, not time-weighted: idle
windows made nothing and count for nothing, and a busy minute at 16 requests weighs what it made. The speedup at a mix
is the time the target alone takes to make those tokens over the time the drafter takes (a harmonic mean of the
per-concurrency throughputs), so a drafter that wins at 1 and loses at 16 is judged by how much of the output each
batch size makes."""

from __future__ import annotations

import math

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the concurrencies a mix is measured at: powers of two, as the load curve's


class LoadMixError(ValueError):
    pass


def level(mean_batch: float) -> int:
    """The measured concurrency nearest a window's mean batch, on a log scale (a mean under 1.5 is one request)."""
    if not mean_batch or mean_batch < 1:
        return 1
    return min(LEVELS, key=lambda c: abs(math.log2(c) - math.log2(mean_batch)))


def from_windows(windows: list[tuple[float, float]], max_levels: int = 3, min_share: float = 0.05) -> dict[int, float]:
    """The mix from (mean batch, output tokens) per window: the output share at each level, the `max_levels` largest
    kept (the gate's cost grows with each) and any under `min_share` dropped, the rest renormalized. {} when no
    window made output."""
    made: dict[int, float] = {}
    for mean_batch, tokens in windows:
        if tokens and tokens > 0:
            made[level(mean_batch)] = made.get(level(mean_batch), 0.0) + float(tokens)
    total = sum(made.values())
    if not total:
        return {}
    kept = sorted(made.items(), key=lambda kv: -kv[1])[:max(1, max_levels)]
    kept = [(c, t) for i, (c, t) in enumerate(kept) if i == 0 or t / total >= min_share]
    kept_total = sum(t for _, t in kept)
    return {c: round(t / kept_total, 4) for c, t in sorted(kept)}


def check(mix: dict) -> dict[int, float]:
    """A mix given by hand ({"1": 0.7, "16": 0.3}, keys as text in run config): positive whole concurrencies and
    positive shares, renormalized to sum to 1."""
    out: dict[int, float] = {}
    for c, share in mix.items():
        try:
            ci = int(c)
        except (TypeError, ValueError):
            raise LoadMixError(f"load mix key {c!r} is not a concurrency: give whole numbers of requests in flight, "
                               "e.g. {\"1\": 0.7, \"16\": 0.3}") from None
        if ci < 1 or not share or share <= 0:
            raise LoadMixError(f"load mix {c!r}: {share!r}: concurrencies are 1 or more and shares above 0")
        out[ci] = out.get(ci, 0.0) + float(share)
    if not out:
        raise LoadMixError("the load mix is empty: give at least one concurrency and its share, or leave it unset")
    total = sum(out.values())
    return {c: s / total for c, s in sorted(out.items())}


def speedup(mix: dict[int, float], tok_s: dict[int, float], base_tok_s: dict[int, float]) -> float | None:
    """The drafter's speedup over the target alone at the mix: sum(share / base) / sum(share / drafter)."""
    if any(not tok_s.get(c) or not base_tok_s.get(c) for c in mix):
        return None
    return sum(s / base_tok_s[c] for c, s in mix.items()) / sum(s / tok_s[c] for c, s in mix.items())


def describe(mix: dict[int, float]) -> str:
    return ", ".join(f"{s:.0%} at {c}" for c, s in sorted(mix.items()))
