"""The main command's deadline: how long training may run so that the stages after it still fit.

Training is the one stage whose length is a free choice (its `time_budget_s`); everything after it (the train
stage's own set-up, export, offline acceptance, the serving benchmark with its two server starts) is a fixed
amount of work whose time depends on the machine. The yardstick for the machine is the regeneration server's
start, measured earlier in the same command (`conversations` metadata `server_ready_s`): Python imports and
model loading, as much of the later work is. Fitted on two 2-core AMD EPYCs: AVX2-only (float32), where that
work took 250 s after a 47 s start (one-process vLLM servers, the benchmark's two started together; before them
326-377 s after starts of 57-65 s, and the serving benchmark alone varies by 40 s from run to run), and
AVX512-BF16 (bf16), about 215 s after a 27 s start with the servers of before: a fixed part and a part that
grows with the start, set to cover each with room for that variation."""

from __future__ import annotations

# With the speculation schedule after the export (issue 47: four servers started together and a sweep at 1, 4 and
# 16 requests, then the benchmark at each): 197 s after the export on the AVX512-BF16 EPYC after an 18 s start,
# where 110 s + 4x the start had covered the work before it.
AFTER_TRAINING_FIXED_S = 170.0
AFTER_TRAINING_PER_SERVER_START = 7.0
FALLBACK_SHARE = 0.3  # of the deadline, kept for the work after training when no server start was measured
MIN_TRAINING_S = 60.0  # below this a drafter is not worth serving: run late rather than train it for nothing


def training_budget(deadline_s: float, elapsed_s: float, configured_s: float | None,
                    server_ready_s: float | None) -> tuple[float, str]:
    """(seconds of training, the reason in a sentence): the configured budget, or less where the deadline
    would otherwise pass; never under MIN_TRAINING_S, and never more than the configured budget (a deadline only
    shortens what the user chose)."""
    if not deadline_s > 0:
        raise ValueError(f"the deadline must be a positive number of seconds, got {deadline_s:g}")
    if server_ready_s:
        reserve = AFTER_TRAINING_FIXED_S + AFTER_TRAINING_PER_SERVER_START * server_ready_s
        why = (f"{reserve:.0f} s kept for what follows training ({AFTER_TRAINING_FIXED_S:g} s + "
               f"{AFTER_TRAINING_PER_SERVER_START:g}x the {server_ready_s:.0f} s the regeneration server took to start)")
    else:
        reserve = FALLBACK_SHARE * deadline_s
        why = f"{reserve:.0f} s kept for what follows training ({FALLBACK_SHARE:.0%} of the deadline: no server start measured)"
    left = deadline_s - elapsed_s - reserve
    budget = left if configured_s is None else min(float(configured_s), left)
    head = f"{elapsed_s:.0f} s of the {deadline_s:.0f} s deadline gone, {why}"
    floor = MIN_TRAINING_S if configured_s is None else min(MIN_TRAINING_S, float(configured_s))
    if budget < floor:
        return floor, f"{head}: the deadline cannot be kept; training gets the minimum {floor:g} s"
    if configured_s is not None and budget >= float(configured_s):
        return float(configured_s), f"{head}: the configured {float(configured_s):g} s fit"
    return round(budget), f"{head}: {round(budget)} s" + (f" of the configured {float(configured_s):g} s"
                                                          if configured_s is not None else "")
