"""Each asset's code_version is a hash of the code it runs (code_versions.py): a change to a module its
stage imports gives it a new one, Dagster then shows it stale, and the lineage names the code change."""

import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
from dagster._core.definitions.data_version import StaleCauseCategory, StaleStatus
from dagster._utils.test.data_versions import get_stale_status_resolver

from eagle3_assets import cli, lineage
from eagle3_assets import code_versions as cv
from eagle3_assets.assets import benchmark_regression, prompts
from eagle3_assets.definitions import all_assets
from eagle3_assets.hosts import LocalGpuHost

DRAFTER = ("eagle3_assets.assets.drafter", "eagle3_drafter")    # the train stage
EXPORT = ("eagle3_assets.assets.export", "drafter_export")      # the export stage
ACCEPT = ("eagle3_assets.assets.acceptance", "offline_acceptance")  # the speculate stage
SHARDS = ("eagle3_assets.assets.hidden_states", "hidden_state_shards")  # the extract stage
BENCH = ("eagle3_assets.assets.serving", "serving_benchmark")   # the serve_bench stage
PROMPTS = ("eagle3_assets.assets.prompts", "prompts")           # no stage: control plane only


def _copy(tmp_path: Path, name: str, edit: str | None = None) -> Path:
    """A copy of the package's Python sources, with the file `edit` (relative to the package) changed."""
    def not_code(folder, names):
        return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]

    root = tmp_path / name / "eagle3_assets"
    shutil.copytree(cv.ROOT, root, ignore=not_code)
    if edit:
        path = root / edit
        path.write_text(path.read_text() + "\n# a change\n")
    return root


def test_the_code_version_changes_with_the_worker_code_the_asset_runs_and_nothing_else(tmp_path):
    same = _copy(tmp_path, "same")
    train = _copy(tmp_path, "train", "worker/training/data.py")  # imported by training/trainer.py, the train stage
    serve = _copy(tmp_path, "serve", "worker/serving/bench.py")  # the serve_bench stage's module

    def v(root, asset):
        return cv.code_version(*asset, root=root)

    assert v(same, DRAFTER) == v(cv.ROOT, DRAFTER)  # the files' bytes, not where they lie
    assert v(train, DRAFTER) != v(same, DRAFTER)
    assert v(train, EXPORT) == v(same, EXPORT) and v(train, BENCH) == v(same, BENCH)
    assert v(serve, BENCH) != v(same, BENCH)
    assert v(serve, DRAFTER) == v(same, DRAFTER) and v(serve, PROMPTS) == v(same, PROMPTS)


def test_a_change_to_one_stages_contract_re_versions_only_the_assets_running_that_stage(tmp_path):
    """The contracts are read by name (stages/__init__.py imports none of them), and an annotation-only import
    (under TYPE_CHECKING) runs nothing: editing the extract contract re-versions the shards, the host
    preflight (which sizes the disk with the extract settings) and the drafter (online from vLLM, the train stage
    launches the engine with them: `online_engine`), and no other asset downstream of them."""
    same, edited = _copy(tmp_path, "same"), _copy(tmp_path, "extract", "stages/extract.py")
    changed = {f"{m}.{f}" for m, f in [DRAFTER, EXPORT, ACCEPT, BENCH, PROMPTS, SHARDS,
                                       ("eagle3_assets.assets.host", "host_preflight"),
                                       ("eagle3_assets.assets.conversations", "conversations"),
                                       ("eagle3_assets.assets.vocab", "vocab_mapping"),
                                       ("eagle3_assets.assets.target", "target_model")]
               if cv.code_version(m, f, root=edited) != cv.code_version(m, f, root=same)}
    assert changed == {"eagle3_assets.assets.hidden_states.hidden_state_shards",
                       "eagle3_assets.assets.host.host_preflight", "eagle3_assets.assets.drafter.eagle3_drafter"}


def test_the_files_hashed_are_the_asset_module_its_stages_and_their_imports():
    drafter = cv.files_of(*DRAFTER)
    assert {"assets/drafter.py", "worker/__main__.py", "worker/training/trainer.py", "worker/training/data.py",
            "stages/train.py"} <= set(drafter)
    assert "worker/serving/bench.py" not in drafter and "worker/serving/export.py" not in drafter
    assert "assets/__init__.py" not in drafter  # `from .x import y` does not tie an asset to every other one
    assert "worker/__main__.py" not in cv.files_of(*PROMPTS)  # it runs no stage
    # host_preflight runs its stage through a helper in its module
    assert cv.stages_run_by(cv.ROOT, "eagle3_assets.assets.host", "host_preflight") == {"engine_check"}
    assert "worker/serving/engine_check.py" in cv.files_of("eagle3_assets.assets.host", "host_preflight")
    # an engine runs some of its files by module path (vLLM's connector, SGLang's capture): all of them count
    assert {"worker/engines/vllm/connector.py", "worker/engines/sglang/capture.py"} <= set(cv.files_of(*SHARDS))
    versions = {a.key.to_user_string(): a.code_versions_by_key[a.key] for a in all_assets}
    assert versions["eagle3_drafter"] == cv.code_version(*DRAFTER)
    assert all(len(v) == 12 for v in versions.values()) and versions["eagle3_drafter"] != versions["drafter_export"]


def test_computing_code_versions_imports_neither_torch_nor_dagster():
    done = subprocess.run([sys.executable, "-c", (
        "import sys; from eagle3_assets import code_versions as cv; "
        "[cv.code_version(m, f) for m, f in [('eagle3_assets.assets.drafter', 'eagle3_drafter'), "
        "('eagle3_assets.assets.serving', 'serving_benchmark'), ('eagle3_assets.assets.hidden_states', "
        "'hidden_state_shards')]]; print(sorted(m for m in ('torch', 'transformers', 'dagster') if m in sys.modules))")],
        capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _benchmark(instance: dg.DagsterInstance, prompts_storage_id: int) -> int:
    """A serving_benchmark result as a run records it: the same figures and settings, consuming `prompts`."""
    instance.report_runless_asset_event(dg.AssetMaterialization(
        "serving_benchmark", partition="vllm", metadata={"engine": "vllm", "acceptance_length": 2.0, "speedup": 1.5,
                                                  "acceptance_per_pos": [0.275, 0.10277777777777777, 0.0305555555]},
        tags={"dagster/code_version": cv.code_version(*BENCH), "dagster/data_version": "same",
              "dagster/input_event_pointer/prompts": str(prompts_storage_id)}))
    return instance.fetch_materializations(dg.AssetKey("serving_benchmark"), limit=1).records[0].storage_id


def test_a_code_change_makes_the_asset_stale_and_is_named_in_the_lineage(tmp_path, monkeypatch, capsys):
    # `prompts` as the definitions would load it after an edit to the module it reads its sources with
    edited = cv.code_version(*PROMPTS, root=_copy(tmp_path, "edited", "sources/prompt_files.py"))
    assert edited != cv.code_version(*PROMPTS)
    changed = prompts.map_asset_specs(lambda spec: spec.replace_attributes(code_version=edited))
    small = {"ops": {"prompts": {"config": {"max_train_conversations": 6}}}}
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        host = LocalGpuHost(workdir=str(tmp_path / "work"))
        assert dg.materialize([prompts], instance=instance, resources={"gpu_host": host}, run_config=small).success
        assert get_stale_status_resolver(instance, [prompts]).get_status(prompts.key) == StaleStatus.FRESH
        resolver = get_stale_status_resolver(instance, [changed])
        assert resolver.get_status(prompts.key) == StaleStatus.STALE  # what the UI shows
        assert [(c.category, c.reason) for c in resolver.get_stale_causes(prompts.key)] == \
            [(StaleCauseCategory.CODE, "has a new code version")]

        before = instance.fetch_materializations(prompts.key, limit=1).records[0]
        assert dg.materialize([changed], instance=instance, resources={"gpu_host": host}, run_config=small).success
        after = instance.fetch_materializations(prompts.key, limit=1).records[0]
        data = [r.event_log_entry.asset_materialization.tags["dagster/data_version"] for r in (before, after)]
        assert data[0] == data[1]  # the same prompts: only the code differs between the two results below
        old, new = _benchmark(instance, before.storage_id), _benchmark(instance, after.storage_id)

        code = f"the code changed: prompts {cv.code_version(*PROMPTS)} -> {edited}"
        rows = lineage.history(instance)
        assert lineage.differences(rows[0], rows[1]) == [code]
        report = {"ops": {"benchmark_regression": {"config": {"new_storage_id": new, "old_storage_id": old,
                                                               "why": "vllm: acceptance_length dropped"}}}}
        assert dg.materialize([benchmark_regression], instance=instance, run_config=report).success
        ev = instance.get_latest_materialization_event(benchmark_regression.key)
        assert ev.asset_materialization.metadata["changed"].value == [code]

        monkeypatch.setenv("DAGSTER_HOME", instance.root_directory)
        assert cli.main(["lineage", "--explain", "1"]) == 0
        out = capsys.readouterr().out
        assert f"against the previous result: {code}" in out and f"code {edited}" in out
        assert "[0.275, 0.103, 0.031]" in out and "0.1027" not in out  # per position as the AL column: 3 decimals

        # a result that is not there: the valid range, not a traceback
        assert cli.main(["lineage", "--explain", "2"]) == 2
        err = capsys.readouterr().err
        assert "--explain 2: no such result; the history has 2 (numbered 0 to 1" in err
        assert cli.main(["lineage", "--engine", "sglang", "--explain", "0"]) == 0  # none for that engine: said so
        assert "no serving_benchmark results" in capsys.readouterr().out
