"""A training time budget (`time_budget_s`): the run times its first steps, keeps the steps that fit, and
plans the learning-rate schedule for those, so a slow machine gets a finished schedule, not a cut one."""

from __future__ import annotations

import json
import re

import torch

from conftest import run_stage, train_args

LONG = {"epochs": 40, "save_every_steps": 0}


def _last_checkpoint(d):
    return torch.load(sorted((d / "checkpoints").glob("step-*"))[-1] / "training_state.pt", weights_only=False)


def test_a_budget_cuts_the_run_and_finishes_its_schedule(built, work):
    run = run_stage(work, "train", train_args(built, "drafter/budget", **LONG, time_budget_s=2.0))
    assert run.returncode == 0, run.stderr[-3000:]
    meta = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0 < meta["steps"], meta
    said = re.search(r"time budget 2 s: (\d+) of (\d+) steps", run.stderr)
    assert said, run.stderr[-3000:]
    planned, requested = int(said[1]), int(said[2])
    # a machine that got busier after the calibration cuts again at an epoch's end (never adds steps)
    recut = re.findall(r"time budget 2 s: the last epoch ran slower than the calibration; (\d+) steps now fit",
                       run.stderr)
    if recut:
        assert int(recut[-1].replace(",", "")) <= planned
        planned = int(recut[-1].replace(",", ""))
    assert meta["steps"] == planned < requested
    state = _last_checkpoint(work / "drafter/budget")
    lr, peak = state["scheduler"]["_last_lr"][0], state["scheduler"]["base_lrs"][0]
    assert lr < 0.05 * peak, f"the schedule was not planned for the cut run: lr {lr} of peak {peak}"

    again = run_stage(work, "train", train_args(built, "drafter/budget", **LONG, time_budget_s=2.0))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(step {planned} of {planned})" in again.stderr, "a resume keeps the plan, not re-timed"


def test_a_budget_that_fits_every_epoch_changes_nothing(built, work):
    plain = run_stage(work, "train", train_args(built, "drafter/plain"))
    budgeted = run_stage(work, "train", train_args(built, "drafter/roomy", time_budget_s=3600))
    assert plain.returncode == 0 and budgeted.returncode == 0, budgeted.stderr[-3000:]
    a = json.loads(plain.stdout.strip().splitlines()[-1])
    b = json.loads(budgeted.stdout.strip().splitlines()[-1])
    assert b["steps"] == a["steps"] and b["loss"] == a["loss"], (a, b)


def test_an_epoch_that_ran_slower_than_the_calibration_cuts_the_later_epochs():
    """The budget is rechecked at each epoch's end at that epoch's pace: a machine that got busier after the
    first steps were timed still ends near its budget, and one on pace keeps its plan."""
    from eagle3_assets.worker.training.distributed import Group
    from eagle3_assets.worker.training.schedule import recheck_budget

    group = Group("cpu")
    # 100 s budget, 40 s gone at step 100 of 300 planned: 0.2 s/step fits (200 steps, 40 s), 0.6 s/step does not
    assert recheck_budget(now=40.0, t0=0.0, budget=100.0, step=100, total=300, per_step=0.2, group=group) is None
    cut = recheck_budget(now=40.0, t0=0.0, budget=100.0, step=100, total=300, per_step=0.6, group=group)
    assert cut == 100 + int(0.97 * 60 / 0.6)
    assert recheck_budget(now=120.0, t0=0.0, budget=100.0, step=100, total=300, per_step=0.6, group=group) == 100
