"""The control-plane/worker boundary and the lint, as tests (seconds; no model is loaded).

The boundary is import-linter's contracts in pyproject.toml ([tool.importlinter]): the worker never imports
dagster (dagster_pipes is its channel) nor the control plane; the control plane never imports the worker nor
torch and the worker's other packages; what both read (common/, stages/) imports neither; the worker's stage
families are layered; no package has an import circle. `lint-imports` in the repo root checks them.
"""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10; dagster requires tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
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


def test_contracts_name_the_control_plane_by_wildcard():
    """The control plane is named by wildcard (`eagle3_assets.*`), never module by module: a new module or package
    of the control plane is under every contract with no edit to them (test_import_contracts_catch_violations
    plants violations in modules the contracts have never heard of)."""
    contracts = _contracts()
    for cid in ["control-no-worker", "control-no-torch", "worker-self-contained", "shared-leaves"]:
        c = contracts[cid]
        named = [m for m in c["source_modules"] + c["forbidden_modules"] if m.startswith("eagle3_assets.")]
        listed = [m for m in named if m.removeprefix("eagle3_assets.").split(".")[0] not in {"*", "worker", "common", "stages"}]
        assert not listed, f"[tool.importlinter] {cid} names control-plane modules one by one: {listed}"


def test_worker_layers_name_every_worker_module():
    """Each package and module of the worker sits in one layer: a new one must be placed (its layer says what
    it may import)."""
    layers = {name.strip() for layer in _contracts()["worker-layers"]["layers"] for name in layer.split("|")}
    here = {m.name for m in pkgutil.iter_modules([str(ROOT / "eagle3_assets" / "worker")])}
    assert here == layers, f"[tool.importlinter] worker-layers: place {sorted(here - layers)}, drop {sorted(layers - here)}"


def _violate(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(f"\n\ndef _violation():\n    {line}  # noqa\n")


def test_import_contracts_catch_violations(tmp_path):
    """The same config on a copy of the package with one violation of each contract: all seven break, each
    naming the import that breaks it (so a passing check is not a check that sees nothing), also in modules that
    are new to the contracts."""
    shutil.copytree(ROOT / "eagle3_assets", tmp_path / "eagle3_assets",
                    ignore=shutil.ignore_patterns("__pycache__", "*.jsonl", "*.yaml"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    pkg = tmp_path / "eagle3_assets"
    _violate(pkg / "worker" / "output_lock.py", "import dagster")  # the worker importing dagster itself
    _violate(pkg / "worker" / "errors.py", "from .. import lineage")  # the worker importing the control plane
    _violate(pkg / "assets" / "serving.py", "from ..worker import files")  # the control plane importing the worker
    _violate(pkg / "common" / "charts.py", "import torch")  # a shared module the control plane imports, reaching torch
    _violate(pkg / "stages" / "base.py", "from ..worker import files")  # a shared contract reaching a half
    # a lower family importing a higher one: a layer broken, and a circle (training imports target)
    _violate(pkg / "worker" / "target" / "model.py", "from ..training import checkpoint")
    # modules no contract names: a new root module and a new package of the control plane, each breaking a rule
    (pkg / "new_root_module.py").write_text("import torch  # noqa\n")
    (pkg / "new_room").mkdir()
    (pkg / "new_room" / "__init__.py").write_text("")
    (pkg / "new_room" / "feature.py").write_text("from ..worker import files  # noqa\n")
    (pkg / "worker" / "new_stage.py").write_text("from ..new_room import feature  # noqa\n")
    r = _lint_imports(tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "0 kept, 7 broken" in out, out
    for chain in ["eagle3_assets.worker.output_lock -> dagster",
                  "eagle3_assets.worker.errors -> eagle3_assets.lineage",
                  "eagle3_assets.assets.serving -> eagle3_assets.worker.files",
                  "eagle3_assets.common.charts -> torch",
                  "eagle3_assets.stages.base -> eagle3_assets.worker.files",
                  "eagle3_assets.worker.target.model -> eagle3_assets.worker.training.checkpoint",
                  "eagle3_assets.new_root_module -> torch", "eagle3_assets.new_room.feature -> eagle3_assets.worker.files",
                  "eagle3_assets.worker.new_stage -> eagle3_assets.new_room.feature"]:
        assert chain in out, f"{chain!r} not reported:\n{out}"


def test_control_plane_loads_no_worker_packages():
    """At run time too: the Dagster code location and the CLI load without torch & co."""
    code = ("import sys, eagle3_assets.definitions, eagle3_assets.cli, eagle3_assets.lineage\n"
            f"print(sorted(m for m in {WORKER_ONLY!r} if m in sys.modules))")
    r = _run([sys.executable, "-c", code], ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", f"the control plane loaded {r.stdout.strip()}"


def test_ruff_clean():
    r = _run([str(BIN / "ruff"), "check", "--no-cache", "--output-format", "concise", "."], ROOT)
    assert r.returncode == 0, f"ruff check (config: [tool.ruff] in pyproject.toml) found:\n{r.stdout}{r.stderr}"


def test_the_control_plane_keeps_its_rooms():
    """The shape a newcomer relies on (docs/development.md: the package by concern): the package root keeps at
    most 8 modules, what the whole product shares; a feature lives in its own folder; no module name is used twice
    in the control plane, so a name says which file it is."""
    pkg = ROOT / "eagle3_assets"
    root = sorted(p.name for p in pkg.glob("*.py"))
    assert len(root) <= 8, f"{len(root)} modules at the package root: {root}; put a feature's modules in its folder"
    control = [p for p in pkg.rglob("*.py") if p.name != "__init__.py"
               and p.relative_to(pkg).parts[0] not in {"worker", "stages", "common"}]
    names: dict[str, list[str]] = {}
    for p in control:
        names.setdefault(p.stem, []).append(str(p.relative_to(pkg)))
    twice = {n: ps for n, ps in names.items() if len(ps) > 1}
    assert not twice, f"module names used twice in the control plane: {twice}"
    for room, concern in [("eye", "live_acceptance"), ("eye", "drift_report"), ("eye", "traffic"),
                          ("loop", "promotion"), ("loop", "rollout"), ("loop", "production"),
                          ("sources", "redact"), ("sources", "gateway_logs")]:
        assert names.get(concern) == [f"{room}/{concern}.py"], f"{concern}: expected in {room}/, found {names.get(concern)}"


def test_an_asset_reaches_only_the_root_modules_the_whole_product_shares():
    """An asset's walk from its function to the host goes through its own room, the shared layers and hosts/: of
    the package root it may reach only code versions and lineage (bench/package_shape.py prints the walks)."""
    import grimp

    graph = grimp.build_graph("eagle3_assets", cache_dir=None)
    shared = {"code_versions", "lineage", "__init__"}
    root = {p.stem for p in (ROOT / "eagle3_assets").glob("*.py")} - shared
    assets = [m for m in graph.modules if m.split(".")[1:2] in (["assets"], ["eye"], ["loop"])
              and "@dg.asset" in _module_source(m)]
    assert len(assets) >= 15, f"asset modules not found: {assets}"
    for m in assets:
        reached = {r for r in root if f"eagle3_assets.{r}" in graph.find_upstream_modules(m)}
        assert not reached, f"{m} reaches the root module(s) {sorted(reached)}: move what it needs into a room"


def _module_source(module: str) -> str:
    path = ROOT / (module.replace(".", "/") + ".py")
    return path.read_text() if path.exists() else ""
