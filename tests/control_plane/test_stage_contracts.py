"""One contract per stage (eagle3_assets/stages): the worker refuses a bad argument before it imports torch,
naming it; `--help` lists each stage's arguments; the Dagster configs are the same models, so the launchpad
and the worker cannot disagree on a default; what a stage reports is checked against what the other half
reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets import stages
from eagle3_assets.assets.acceptance import OfflineAcceptanceConfig
from eagle3_assets.assets.conversations import ConversationsConfig
from eagle3_assets.assets.drafter import DrafterConfig
from eagle3_assets.assets.export import ExportConfig
from eagle3_assets.assets.hidden_states import HiddenStatesConfig
from eagle3_assets.assets.serving import ServingBenchmarkConfig
from eagle3_assets.assets.speculation_schedule import ScheduleConfig
from eagle3_assets.assets.synthetic_prompts import SyntheticPromptsConfig
from eagle3_assets.assets.target import TargetModelConfig
from eagle3_assets.assets.vocab import VocabConfig

ROOT = Path(__file__).resolve().parents[2]

# Run the worker's entry point in a fresh interpreter and say whether torch got imported on the way.
PROBE = """
import sys
from eagle3_assets.worker.__main__ import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
""".replace("import sys", "import json, sys", 1)


def _worker(*argv: str, tmp_path: Path) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)})
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("args, named", [
    ({}, ["target: required", "out: required"]),
    ({"target": "t", "out": "drafter/x"}, ["shards: required for hidden_states offline"]),
    ({"target": "t", "out": "drafter/x", "hidden_states": "online"}, ["conversations: required for hidden_states online"]),
    ({"target": "t", "shards": ["s"], "out": "drafter/x", "epochs": 0}, ["epochs: Input should be greater than 0"]),
    ({"target": "t", "shards": ["s"], "out": "drafter/x", "loss": "mse"}, ["loss: Input should be 'soft' or 'hard'"]),
    ({"target": "t", "shards": ["s"], "out": "drafter/x", "epoch": 3}, ["epoch: not a train argument"]),
    ({"target": "t", "shards": ["s"], "out": "drafter/../../etc"}, ["out: 'drafter/../../etc' contains '..'"]),
])
def test_a_bad_train_argument_is_refused_by_name_before_torch_is_imported(tmp_path, args, named):
    out, err = _worker("train", "--workdir", str(tmp_path), "--args", json.dumps(args), tmp_path=tmp_path)
    assert out == {"rc": 2, "torch": False}, err
    for words in named:
        assert words in err, err
    assert "Traceback" not in err and "KeyError" not in err
    assert "python -m eagle3_assets.worker train --help" in err  # where to look
    assert not (tmp_path / "drafter").exists()  # nothing written


def test_unreadable_arguments_are_named_too(tmp_path):
    out, err = _worker("export", "--workdir", str(tmp_path), "--args", "{not json", tmp_path=tmp_path)
    assert out == {"rc": 2, "torch": False}
    assert "cannot read the export arguments from --args" in err


@pytest.mark.parametrize("stage", stages.NAMES)
def test_help_lists_every_argument_of_the_stage_with_its_default(stage, tmp_path):
    r = subprocess.run([sys.executable, "-m", "eagle3_assets.worker", stage, "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name, field in stages.contract(stage).args.model_fields.items():
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith(f"  {name}: ")), None)
        assert line is not None, f"{name} missing from {stage} --help:\n{r.stdout}"
        want = "required" if field.is_required() else f"default {json.dumps(field.get_default(call_default_factory=True))}"
        assert want in line, line


# Each asset's Dagster config and the stage it runs: (config, stage, fields only the control plane has)
CONFIGS = [
    (TargetModelConfig, "prepare_target", set()),
    (SyntheticPromptsConfig, "synthesize", set()),
    (ConversationsConfig, "generate", {"samples_per_shard"}),
    (HiddenStatesConfig, "extract", set()),
    (VocabConfig, "vocab", set()),
    (DrafterConfig, "train", {"integration_gate", "integration_engine"}),
    (ExportConfig, "export", set()),
    (OfflineAcceptanceConfig, "speculate", {"eval_set"}),
    (ServingBenchmarkConfig, "serve_bench", {"eval_set", "min_ratio_to_offline", "schedule", "schedule_tolerance"}),
    (ScheduleConfig, "load_curve", {"eval_set"}),
]


@pytest.mark.parametrize("config, stage, own", CONFIGS, ids=[c[1] for c in CONFIGS])
def test_the_launchpad_shows_the_stages_own_fields_and_defaults(config, stage, own):
    """What the launchpad offers is what the worker takes: every config field is a stage argument (or one the
    control plane consumes itself), with the stage's default, and the config's defaults validate as the stage's
    arguments once the asset's paths are added."""
    args_model = stages.contract(stage).args
    schema = config.to_config_schema().as_field().config_type.fields
    assert set(schema) == set(config.model_fields)
    for name in set(config.model_fields) - own:
        assert name in args_model.model_fields, f"{config.__name__}.{name} is not a {stage} argument"
        assert config.model_fields[name].get_default(call_default_factory=True) == \
            args_model.model_fields[name].get_default(call_default_factory=True), name
    required = {n: "x" for n, f in args_model.model_fields.items() if f.is_required()}
    # train's shards are required by hidden_states offline (its default), not by the field
    required.update({k: ["x"] for k in ("shards",) if k in args_model.model_fields and k not in config.model_fields})
    required.update({k: 0 for k in ("shard",) if k in required})
    required.update({k: 1 for k in ("samples_per_shard",) if k in required and k not in config.model_fields})
    stages.validate(stage, {**config().model_dump(exclude=own), **required})


def test_a_bad_setting_fails_the_step_as_it_starts_naming_it(tmp_path):
    """The same bounds in the Dagster config: a launchpad value out of range fails the step as it starts
    (Dagster's own schema checks types; the model checks bounds), before the asset asks the host anything."""
    from eagle3_assets.definitions import defs

    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        job = defs.resolve_implicit_global_asset_job_def().get_subset(asset_selection={dg.AssetKey("eagle3_drafter")})
        result = job.execute_in_process(instance=instance, raise_on_error=False, run_config={
            "ops": {"eagle3_drafter": {"config": {"ttt_steps": 0}}}})
        assert not result.success
        failure = result.get_step_failure_events()[0].step_failure_data.error
        assert "ttt_steps" in str(failure) and "greater than 0" in str(failure), failure
        assert "run_stage" not in str(failure)  # it never got as far as the host


def test_a_report_missing_what_the_other_half_reads_fails_where_it_is_made():
    from eagle3_assets.worker.report import Reporter

    rep = Reporter()
    rep.stage = "train"
    with pytest.raises(stages.ArgsError, match="bad train metadata: path: required, missing"):
        rep.materialize({"epochs": 3})
    rep.stage = "serve_bench"
    with pytest.raises(stages.ArgsError, match="num_speculative_tokens: required"):
        rep.materialize({"engine": "vllm", "acceptance_length": 1.5})
    rep.stage = "generate"
    with pytest.raises(stages.ArgsError, match="conversations: required"):
        rep.result({"path": "x"})
    rep.result({"path": "x", "conversations": 3})  # what it does report passes


def test_every_stage_has_its_contract_and_gets_it_as_a_typed_model():
    """The worker's registry and the contracts name the same stages; a stage is handed its Args model (attributes
    with every default filled in), not a dict of strings."""
    from eagle3_assets.stages.train import TrainArgs
    from eagle3_assets.worker.stages import STAGES

    assert set(STAGES) == set(stages.NAMES)
    args = stages.validate("train", {"target": "t", "shards": ["s"], "out": "drafter/x", "ttt_steps": 3})
    assert isinstance(args, TrainArgs) and args.ttt_steps == 3 and args.epochs == TrainArgs.model_fields["epochs"].default
