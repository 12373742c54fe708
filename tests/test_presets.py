"""The main command's embedded-default preset, as each kind of CPU gets it: a run config every job of the
command accepts (a typo in the smaller preset would break the command only where bf16 is missing), and
the smaller one really smaller."""

import dagster as dg
import pytest

from eagle3_assets.cli import _ops_config, embedded_preset
from eagle3_assets.definitions import PREPARE_DATA, TRAIN_DRAFTER, defs

JOBS = {"check_host": ["host_preflight"], "prepare_data": PREPARE_DATA, "extract_hidden_states": ["hidden_state_shards"],
        "train_drafter": TRAIN_DRAFTER, "benchmark_serving": ["serving_benchmark"]}


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_each_cpu_kind_gets_a_preset_every_job_accepts(cpu_bf16):
    config, names = embedded_preset(cpu_bf16)
    assert names[0] == "embedded_cpu.yaml" and (len(names) == 1) == cpu_bf16
    for job, assets in JOBS.items():
        # raises DagsterInvalidConfigError naming the field: an unknown key, a wrong type
        dg.validate_run_config(defs.resolve_job_def(job), _ops_config(config, assets))


def test_without_bf16_the_work_is_cut_and_training_has_a_time_budget():
    big, _ = embedded_preset(True)
    small, _ = embedded_preset(False)
    ops = lambda c, a: c["ops"][a]["config"]  # noqa: E731
    assert ops(small, "prompts")["max_train_conversations"] < ops(big, "prompts")["max_train_conversations"]
    assert ops(small, "conversations")["max_new_tokens"] < ops(big, "conversations")["max_new_tokens"]
    assert ops(small, "eagle3_drafter")["time_budget_s"] > 0 and "time_budget_s" not in ops(big, "eagle3_drafter")
    # what the overlay does not name is the recipe's, untouched
    assert {k: v for k, v in ops(small, "eagle3_drafter").items() if k != "time_budget_s"} == \
        {k: v for k, v in ops(big, "eagle3_drafter").items() if k != "time_budget_s"}
