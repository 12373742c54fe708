"""The main command's deadline: training gets what is left once the work after it is kept aside."""

from eagle3_assets.deadline import (
    AFTER_TRAINING_FIXED_S,
    AFTER_TRAINING_PER_SERVER_START,
    FALLBACK_SHARE,
    MIN_TRAINING_S,
    training_budget,
)


def test_the_configured_budget_stands_while_the_deadline_is_far():
    budget, why = training_budget(deadline_s=840, elapsed_s=100, configured_s=240, server_ready_s=20)
    assert budget == 240 and "configured 240 s fit" in why


def test_a_slow_machine_trains_for_what_is_left_after_the_work_that_follows():
    ready = 30.0
    early, _ = training_budget(840, 250, 240, ready)
    late, why = training_budget(840, 320, 240, ready)
    assert late < early < 240
    # what is left is the deadline less the time gone and the reserve the server start predicts
    assert abs(late - (840 - 320 - AFTER_TRAINING_FIXED_S - AFTER_TRAINING_PER_SERVER_START * ready)) <= 0.5
    assert "30 s the regeneration server took to start" in why


def test_without_a_measured_server_start_a_share_of_the_deadline_is_kept():
    budget, why = training_budget(1000, 200, None, None)
    assert abs(budget - (1000 - 200 - FALLBACK_SHARE * 1000)) <= 0.5
    assert "no server start measured" in why


def test_a_deadline_already_lost_still_trains_the_minimum_and_says_so():
    budget, why = training_budget(840, 800, 240, 60)
    assert budget == MIN_TRAINING_S and "cannot be kept" in why


def test_a_deadline_never_raises_a_configured_budget():
    # a short configured budget is what the user chose: the deadline's minimum must not lengthen it
    budget, why = training_budget(30, 20, 5, 40)
    assert budget == 5 and "minimum 5 s" in why
    assert training_budget(30, 20, None, 40)[0] == MIN_TRAINING_S


def test_the_main_command_refuses_a_deadline_that_is_not_positive(capsys):
    import pytest

    from eagle3_assets.cli import main

    for bad in ("-30", "0", "nan", "soon"):
        with pytest.raises(SystemExit) as e:
            main(["materialize", "--deadline", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--deadline" in err and ("positive" in err or "not a number" in err), err
    with pytest.raises(ValueError, match="positive"):
        training_budget(-30, 0, 240, 40)
