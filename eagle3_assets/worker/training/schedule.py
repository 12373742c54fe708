"""The learning-rate schedule, and a time budget turned into a number of steps (the schedule replanned for it)."""

from __future__ import annotations

import math

CALIBRATION_STEPS = 6  # steps timed before a time budget plans the run (the first, warming up, not counted)


def lr_lambda(total_steps: int, warmup: int):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return f


def plan_budget(now: float, t0: float, t_first: float, budget: float, step: int, total: int, group) -> int:
    """How many steps fit the training time budget, from the calibration steps' pace (every rank agrees: the
    slowest sets it). 3 % is kept back for the epoch-end checkpoints."""
    per_step = group.max((now - t_first) / CALIBRATION_STEPS)
    left = group.max(budget - (now - t0))
    return max(step + 1, min(total, step + int(0.97 * left / per_step)))


def recheck_budget(now: float, t0: float, budget: float, step: int, total: int, per_step: float, group) -> int | None:
    """At an epoch's end: the steps that still fit at the pace of the epoch just done (a machine that got busier
    after the calibration), or None when the plan still fits within 10 %. Never more steps than planned."""
    per_step = group.max(per_step)
    left = group.max(budget - (now - t0))
    if (total - step) * per_step <= 1.1 * max(left, 0.0):
        return None
    return min(total, step + max(0, int(0.97 * left / per_step)))


def replan(steps_of: list[list], sched, planned: int, warmup_ratio: float) -> int:
    """Cut the epoch plans (in place) to their first `planned` steps and schedule the learning rate for that
    many: warmup and decay over the run that will happen, not the one that was asked for."""
    left = planned
    for i, plan in enumerate(steps_of):
        if left <= 0:
            del steps_of[i:]
            break
        del plan[left:]
        left -= len(plan)
    sched.lr_lambdas = [lr_lambda(planned, max(1, int(planned * warmup_ratio)))] * len(sched.lr_lambdas)
    return planned
