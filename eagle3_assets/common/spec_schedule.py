"""A speculation schedule by load: how many tokens to draft (k) at each batch size, k = 0 where speculation
would slow serving down. Chosen from a measured load curve (throughput per k at a grid of concurrencies), checked
before any server starts, and written in each engine's own form: vLLM's `num_speculative_tokens_per_batch_size`
(inclusive `[first, last, k]` ranges in the speculative config) and SGLang's adaptive speculation config (a JSON
file for `--speculative-adaptive-config`, keyed by the batch size each slot starts at).

Both halves read it: the control plane checks a schedule a user gives and records the chosen one; the worker
writes it into the export's launch files and starts servers with it. Standard library only."""

from __future__ import annotations

import json
import statistics

Schedule = list[tuple[int, int, int]]  # (first batch size, last batch size, k), inclusive, sorted


class ScheduleError(ValueError):
    """A schedule no engine should be started with; the message names the range and what to change."""


def check(schedule, max_batch: int | None = None) -> Schedule:
    """The schedule as sorted (first, last, k) tuples, or a ScheduleError naming the first bad range. Stricter than
    vLLM's own check (which fills gaps by carrying k forward): every batch size from 1 to `max_batch` must be in
    exactly one range, so no batch size runs a k nobody chose."""
    if not isinstance(schedule, list | tuple) or not schedule:
        raise ScheduleError("a speculation schedule is a non-empty list of [first, last, k] batch-size ranges, "
                            f"got {schedule!r}")
    out: Schedule = []
    for entry in schedule:
        if not isinstance(entry, list | tuple) or len(entry) != 3 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in entry):
            raise ScheduleError(f"range {entry!r}: each range is [first, last, k], three integers")
        first, last, k = entry
        if first < 1 or last < first:
            raise ScheduleError(f"range [{first}, {last}, {k}]: batch sizes run from 1 up, first <= last")
        if k < 0:
            raise ScheduleError(f"range [{first}, {last}, {k}]: k is the number of drafted tokens, 0 or more")
        out.append((first, last, k))
    out.sort()
    if out[0][0] != 1:
        raise ScheduleError(f"range {list(out[0])}: the first range must start at batch size 1 (one request alone "
                            "must have a k too)")
    for (f0, l0, k0), (f1, l1, k1) in zip(out, out[1:]):
        if f1 <= l0:
            raise ScheduleError(f"ranges {[f0, l0, k0]} and {[f1, l1, k1]} overlap at batch size {f1}: each batch "
                                "size belongs to one range")
        if f1 != l0 + 1:
            raise ScheduleError(f"ranges {[f0, l0, k0]} and {[f1, l1, k1]} leave batch sizes {l0 + 1}-{f1 - 1} "
                                "without a k: make the ranges contiguous")
    if max_batch is not None and out[-1][1] < max_batch:
        raise ScheduleError(f"range {list(out[-1])}: the schedule ends at batch size {out[-1][1]}, below the "
                            f"engine's limit of {max_batch} concurrent requests: extend the last range to {max_batch}")
    return out


def k_at(schedule: Schedule, batch: int) -> int:
    """The k the schedule drafts at this batch size (the last range's past its end, as vLLM does)."""
    for first, last, k in schedule:
        if first <= batch <= last:
            return k
    return schedule[-1][2]


# A k wins at a concurrency when the paired rounds agree it does: the lower quartile of its rounds' ratios to the
# target alone (each round: every server served one batch at that concurrency, in turn) above 1 + WIN_MARGIN, over at
# least MIN_ROUNDS rounds. A median inside the noise is no win: at 4 requests a sweep chose k=2 on +3 % of its means,
# and the same machine then served that schedule at 0.91x.
WIN_MARGIN = 0.02
MIN_ROUNDS = 3


def spread(ratios: list[float]) -> dict:
    """The rounds' ratios summed up: median, lower and upper quartile (inclusive), rounds."""
    xs = sorted(ratios)
    if not xs:
        return {"median": None, "q1": None, "q3": None, "rounds": 0}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": round(statistics.median(xs), 4), "q1": round(q[0], 4), "q3": round(q[2], 4), "rounds": len(xs)}


def wins(ratios: list[float], margin: float = WIN_MARGIN) -> bool:
    """The rule: at least MIN_ROUNDS paired rounds whose lower quartile is above 1 + margin."""
    return spread_wins(spread(ratios), margin)


def spread_wins(s: dict, margin: float = WIN_MARGIN) -> bool:
    """`wins`, on rounds already summed up by `spread`."""
    return s["rounds"] >= MIN_ROUNDS and s["q1"] > 1 + margin


def choose(curve: dict[int, dict[int, float]], max_batch: int, tolerance: float = 0.03,
           rounds: dict[int, dict[int, list[float]]] | None = None) -> tuple[Schedule, list[dict]]:
    """The schedule from a load curve: `curve[k][concurrency]` is output throughput (tokens/s), k = 0 the target
    alone; every k must be measured at the same concurrencies. With `rounds` (`rounds[k][c]`: each paired round's
    ratio of k's tokens/s to the target alone's), a k speculates at a concurrency only where it wins there (`wins`),
    the winner of the best median ratio; the k of the concurrency below is kept where it wins too and its median is
    within `tolerance` (a share) of the best's, so noise does not flip ranges; no winner: off. Without rounds (one
    figure a point), the best throughput, with the same tolerance. Between two measured concurrencies where k falls,
    the lower k starts right after the lower point (no batch size drafts more than the measurement above it allows);
    where k rises, the higher k starts at the higher point. Past the largest concurrency measured nothing is known:
    off up to `max_batch`. Returns the schedule and one row per concurrency (the table for the metadata)."""
    if 0 not in curve:
        raise ScheduleError("the load curve has no k = 0 (the target alone): nothing to compare speculation with")
    points = sorted(curve[0])
    for k, row in curve.items():
        if sorted(row) != points:
            raise ScheduleError(f"k = {k} was measured at concurrencies {sorted(row)}, the target alone at {points}: "
                                "measure every k at the same concurrencies")
    if not points or points[0] != 1:
        raise ScheduleError(f"the load curve starts at concurrency {points[:1]}: measure one request alone (1) too")
    rows, chosen, prev = [], [], None
    for c in points:
        if rounds is not None:
            stats = {k: spread(rounds.get(k, {}).get(c, [])) for k in sorted(curve) if k}
            winners = [k for k in stats if wins(rounds.get(k, {}).get(c, []))]
            best_k = max(winners, key=lambda k: stats[k]["median"]) if winners else 0
            k = prev if prev in winners and best_k and \
                stats[prev]["median"] >= stats[best_k]["median"] * (1 - tolerance) else best_k
            extra = {f"k{kk}_ratio": v for kk, v in stats.items()}
            speedup = stats[k]["median"] if k else 1.0
        else:
            best_k = max(sorted(curve), key=lambda k: curve[k][c])
            best = curve[best_k][c]
            k = prev if prev is not None and curve[prev][c] >= best * (1 - tolerance) else best_k
            extra = {}
            speedup = round(curve[k][c] / curve[0][c], 3) if curve[0][c] else None
        rows.append({"concurrency": c, "k": k, "best_k": best_k,
                     **{f"k{kk}_tok_s": round(curve[kk][c], 2) for kk in sorted(curve)}, **extra,
                     "speedup": speedup})
        chosen.append((c, k))
        prev = k
    return from_points(chosen, max_batch), rows


def from_points(chosen: list[tuple[int, int]], max_batch: int) -> Schedule:
    """The batch-size ranges from the k chosen at each measured concurrency ((concurrency, k), ascending, the first
    1), by choose's rule: where k falls, the lower k starts right after the lower point; where it rises, the higher k
    starts at the higher point; past the largest concurrency measured, off up to `max_batch`."""
    top = min(chosen[-1][0], max_batch)
    schedule: Schedule = []
    start = 1
    for (c, k), nxt in zip(chosen, chosen[1:] + [(top + 1, None)]):
        n, k_next = nxt
        last = c if (k_next is not None and k_next < k) else n - 1
        last = min(max(last, start), top)
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], last, k)
        else:
            schedule.append((start, last, k))
        start = last + 1
        if start > top:
            break
    if top < max_batch:  # not measured: not speculated on
        schedule = schedule[:-1] + [(schedule[-1][0], max_batch, 0)] if schedule[-1][2] == 0 else \
            schedule + [(top + 1, max_batch, 0)]
    return check(schedule, max_batch)


def verify(table: list[dict], verified: dict[int, dict], tolerance: float) -> tuple[list[dict], set[int]]:
    """The sweep's choice at each concurrency (`table`: choose's rows, `speedup` the chosen k's median ratio to the
    target alone) against the scheduled server's own paired rounds there (`verified[c]`: spread() of its batches'
    ratios to the target alone, served in turn). They agree where the verification's median is at most `tolerance`
    (a share) below the sweep's. A concurrency where the schedule drafts falls back to off where the verification
    measured it slower than the target alone (median below 1), or where the two disagree and the verification's own
    rounds do not show a win by the sweep's rule (lower quartile above 1 + WIN_MARGIN, MIN_ROUNDS rounds).
    Returns one row per concurrency both measured, and the concurrencies to serve off."""
    rows, off = [], set()
    for r in table:
        c, k, swept = r["concurrency"], r["k"], r["speedup"]
        got = verified.get(c)
        if not got or got.get("median") is None or swept is None:
            continue
        agrees = got["median"] >= swept * (1 - tolerance)
        won = spread_wins(got)
        falls_back = bool(k) and (got["median"] < 1 or (not agrees and not won))
        if falls_back:
            off.add(c)
        rows.append({"concurrency": c, "k": k, "sweep_speedup": swept, "verified_speedup": got["median"],
                     "verified_q1": got["q1"], "verified_q3": got["q3"], "rounds": got["rounds"],
                     "agrees": agrees, "falls_back_to_off": falls_back})
    return rows, off


def vllm_config(method: str, model: str, schedule: Schedule, **extra) -> dict:
    """vLLM's `--speculative-config` for the schedule: `num_speculative_tokens` is its largest k (vLLM sizes its
    buffers by it), the ranges go in as they are. None when the schedule never speculates."""
    k_max = max(k for _, _, k in schedule)
    if k_max == 0:
        return {}
    cfg = {"method": method, "model": model, "num_speculative_tokens": k_max, **extra}
    if len({k for _, _, k in schedule}) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule]
    return cfg


def sglang_adaptive_config(schedule: Schedule) -> dict:
    """SGLang's adaptive speculation config (the JSON `--speculative-adaptive-config` reads, with
    `--speculative-adaptive`): one slot per range, keyed by its first batch size (SGLang routes a batch to the
    largest key not above it), each with the range's k as its only candidate step, so SGLang follows the measured
    schedule rather than its own generic defaults. For EAGLE-3 with topk 1, k is SGLang's `num_steps`."""
    return {str(first): {"candidate_steps": [k]} for first, _, k in schedule}


def _flag(extra: list[str], names: tuple[str, ...]) -> str | None:
    """The value the last of these flags is given in a command line's extra arguments (argparse's rule), or None."""
    found = None
    for i, a in enumerate(extra):
        name, eq, value = a.partition("=")
        if name in names:
            found = value if eq else (extra[i + 1] if i + 1 < len(extra) else None)
    return found


def launch_refusals(extra: list[str]) -> list[str]:
    """Why vLLM would not serve a schedule with these launch settings (a stage's extra_args), each saying what to do:
    checked before any server starts."""
    dp = _flag(extra, ("--data-parallel-size", "-dp"))
    if dp and dp.isdigit() and int(dp) > 1:
        return [f"--data-parallel-size {dp} in extra_args: vLLM 0.32 drops num_speculative_tokens_per_batch_size "
                "under data parallelism (VllmConfig._maybe_disable_dynamic_sd_for_data_parallel: its ranks could "
                "pick different k) and drafts the schedule's largest k at every load, where the schedule measured it "
                "slower; run one replica a server behind a router (routing.json beside the schedule gives the "
                "threshold), or serve a fixed k"]
    return []


def launch_costs(extra: list[str], block_tokens: int) -> list[str]:
    """What these launch settings cost a drafter's server that the target alone does not pay, in words: for the log
    and the metadata. `block_tokens`: the engine's KV block on this host (vLLM: 128 on a CPU, 16 on a GPU)."""
    if "--no-enable-prefix-caching" in extra:
        return []
    return [f"prefix caching is on (vLLM's default): EAGLE drops the last matched block of every cache hit "
            f"(vllm/v1/core/single_type_kv_cache_manager.py), so a request whose prompt hits the cache prefills up to "
            f"{block_tokens} tokens more than on the target alone, at every k (0 included); long shared system prompts "
            "pay it on every request. disable_eagle_block_drop: true in the speculative config keeps them (the "
            "drafter then lacks the K/V of one position), --no-enable-prefix-caching drops the cache for both"]


def speculate_up_to(schedule: Schedule) -> int:
    """The largest batch size the schedule drafts at (0: never): a fleet's routing threshold, overflow past it going to
    servers without a drafter."""
    return max((last for _, last, k in schedule if k), default=0)


def describe(schedule: Schedule) -> str:
    """'1-4: k=3, 5-12: k=1, 13-256: off' for logs and metadata."""
    return ", ".join(f"{f}-{la}: " + (f"k={k}" if k else "off") for f, la, k in schedule)


def dumps(cfg: dict) -> str:
    """One line a team can pass as it is: `vllm serve ... --speculative-config "$(cat speculative_config.json)"`."""
    return json.dumps(cfg, separators=(",", ":"))
