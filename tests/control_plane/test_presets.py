"""The shipped presets: run configs every job of the main command accepts (a typo would break the command
only at the job that reads it), the default sized to its 15 minutes, the full recipe untouched by the cut."""

import dagster as dg
import pytest

from eagle3_assets.cli import _ops_config, embedded_preset
from eagle3_assets.definitions import PREPARE_DATA, TRAIN_DRAFTER, defs

JOBS = {"check_host": ["host_preflight"], "prepare_data": PREPARE_DATA, "extract_hidden_states": ["hidden_state_shards"],
        "train_drafter": TRAIN_DRAFTER, "benchmark_serving": ["serving_benchmark"]}


def ops(config: dict, asset: str) -> dict:
    return config["ops"][asset]["config"]


@pytest.mark.parametrize("name", ["embedded_cpu.yaml", "embedded_cpu_full.yaml"])
def test_each_preset_is_a_run_config_every_job_accepts(name):
    config = embedded_preset(name)
    for job, assets in JOBS.items():
        # raises DagsterInvalidConfigError naming the field: an unknown key, a wrong type
        dg.validate_run_config(defs.resolve_job_def(job), _ops_config(config, assets))


def test_the_default_cuts_the_work_and_gives_training_a_time_budget():
    small, full = embedded_preset(), embedded_preset("embedded_cpu_full.yaml")
    assert ops(small, "prompts")["max_train_conversations"] < ops(full, "prompts")["max_train_conversations"]
    assert ops(small, "conversations")["max_new_tokens"] < ops(full, "conversations")["max_new_tokens"]
    assert ops(small, "eagle3_drafter")["time_budget_s"] > 0 and "time_budget_s" not in ops(full, "eagle3_drafter")
    # regeneration too is sized by time on a slow CPU; the full recipe regenerates every prompt
    assert ops(small, "conversations")["time_budget_s"] > 0 and "time_budget_s" not in ops(full, "conversations")
    assert ops(small, "offline_acceptance")["limit"] == ops(small, "serving_benchmark")["limit"]  # the same prompts
    # the recipe's choices that the cut does not name stay the full recipe's
    # (the default finetunes the shipped base drafter: init_from, fewer epochs, a lower lr)
    cut = {"time_budget_s", "lr", "rows_per_batch", "init_from", "epochs"}
    assert {k: v for k, v in ops(small, "eagle3_drafter").items() if k not in cut} == \
        {k: v for k, v in ops(full, "eagle3_drafter").items() if k not in cut}
