"""The control-plane/worker boundary and the lint, as tests (seconds; no model is loaded).

The boundary is import-linter's contracts in pyproject.toml ([tool.importlinter]): the worker never imports
dagster (dagster_pipes is its channel) nor the control plane; the control plane never imports torch and the
worker's other packages, directly or through a worker module. `lint-imports` in the repo root checks them.
"""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import eagle3_assets

try:
    import tomllib
except ImportError:  # Python 3.10; dagster requires tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's scripts: lint-imports, ruff
# What the control plane must not load (numpy is left out here: pyarrow and dagster load it themselves)
WORKER_ONLY = ["torch", "transformers", "safetensors", "accelerate", "gguf", "vllm", "sglang"]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_COLOR": "1", "PYTHONDONTWRITEBYTECODE": "1"})


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return _run([str(BIN / "lint-imports"), "--no-cache", "--no-logo"], cwd)


def _contracts() -> dict[str, dict]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in cfg["contracts"]}


def test_import_contracts_hold():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, f"imports across the control-plane/worker boundary:\n{r.stdout}{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout


def test_contracts_name_every_control_plane_module():
    """The control plane is listed module by module (a forbidden contract cannot say "all but worker/"), so a
    new top-level module must be added to both lists, or the contracts would not see it."""
    # stages/ is the contracts both halves share: its own contract (stages-leaf) keeps it free of either half
    here = {m.name for m in pkgutil.iter_modules(eagle3_assets.__path__)} - {"worker", "stages"}
    contracts = _contracts()
    control = {m.removeprefix("eagle3_assets.") for m in contracts["control-no-torch"]["source_modules"]}
    assert control == here, (f"[tool.importlinter] control-no-torch: add {sorted(here - control)}, "
                             f"drop {sorted(control - here)} in source_modules")
    forbidden = {m.removeprefix("eagle3_assets.") for m in contracts["worker-self-contained"]["forbidden_modules"]}
    assert forbidden == here, (f"[tool.importlinter] worker-self-contained: add {sorted(here - forbidden)}, "
                               f"drop {sorted(forbidden - here)} in forbidden_modules")


def test_import_contracts_catch_violations(tmp_path):
    """The same config on a copy of the package with one violation of each contract: all four break, each
    naming the import that breaks it (so a passing check is not a check that sees nothing)."""
    shutil.copytree(ROOT / "eagle3_assets", tmp_path / "eagle3_assets",
                    ignore=shutil.ignore_patterns("__pycache__", "*.jsonl", "*.yaml"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    worker = tmp_path / "eagle3_assets" / "worker"
    with open(worker / "output_lock.py", "a") as f:  # a worker module importing dagster itself
        f.write("\n\ndef _violation():\n    import dagster  # noqa\n")
    with open(worker / "errors.py", "a") as f:  # a worker module importing the control plane
        f.write("\n\ndef _violation():\n    from .. import lineage  # noqa\n")
    with open(worker / "charts.py", "a") as f:  # a light worker module that assets/ imports, reaching torch
        f.write("\n\ndef _violation():\n    import torch  # noqa\n")
    with open(tmp_path / "eagle3_assets" / "stages" / "base.py", "a") as f:  # a shared contract reaching a half
        f.write("\n\ndef _violation():\n    from ..worker import files  # noqa\n")
    r = _lint_imports(tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "0 kept, 4 broken" in out, out
    for chain in ["eagle3_assets.worker.output_lock -> dagster",
                  "eagle3_assets.worker.errors -> eagle3_assets.lineage",
                  "eagle3_assets.worker.charts -> torch",
                  "eagle3_assets.stages.base -> eagle3_assets.worker.files"]:
        assert chain in out, f"{chain!r} not reported:\n{out}"


def test_control_plane_loads_no_worker_packages():
    """At run time too: the Dagster code location and the CLI load without torch & co (the contracts ignore a
    few lazy imports inside worker functions the control plane never calls; this holds them to that)."""
    code = ("import sys, eagle3_assets.definitions, eagle3_assets.cli, eagle3_assets.lineage\n"
            f"print(sorted(m for m in {WORKER_ONLY!r} if m in sys.modules))")
    r = _run([sys.executable, "-c", code], ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", f"the control plane loaded {r.stdout.strip()}"


def test_ruff_clean():
    r = _run([str(BIN / "ruff"), "check", "--no-cache", "--output-format", "concise", "."], ROOT)
    assert r.returncode == 0, f"ruff check (config: [tool.ruff] in pyproject.toml) found:\n{r.stdout}{r.stderr}"
