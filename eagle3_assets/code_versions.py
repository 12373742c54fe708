"""Each asset's Dagster `code_version`, from the code it runs: a hash of its control-plane module, of the
worker stage modules it runs on the host (the `run_stage(context, "<stage>", ...)` calls in its function
and the module-level helpers that function calls), of the worker's entry point, and of every module those
import within this package, transitively. A change to any of them gives the asset a new code version:
Dagster shows it stale ("has a new code version"), and what is downstream once it is rematerialized with
new data. Read with `ast` only: the control plane never imports the worker's torch to compute it."""

from __future__ import annotations

import ast
import hashlib
from functools import cache
from pathlib import Path

PACKAGE = __package__  # "eagle3_assets"
ROOT = Path(__file__).resolve().parent
ENTRY = f"{PACKAGE}.worker.__main__"  # what `python -m eagle3_assets.worker <stage>` runs first
REGISTRY = f"{PACKAGE}.worker.stages"
CONTRACTS = f"{PACKAGE}.stages"  # one module per stage, named after it


def _path(root: Path, module: str) -> Path | None:
    """The file of a module of this package under `root`, or None (not ours, or no such module)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING" or
                                         getattr(test, "attr", None) == "TYPE_CHECKING")


def _walk_running(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`: imports for annotations only never run."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _type_checking(c))


def _imports(root: Path, module: str) -> set[str]:
    """Modules of this package that `module` imports anywhere in its source (function-local imports too)."""
    path = _path(root, module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in _walk_running(_tree(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            subs = [f"{base}.{a.name}" for a in node.names if _path(root, f"{base}.{a.name}")]
            out.update(subs)
            # `from pkg import submodule` runs pkg/__init__.py too, but what the importer uses is the submodule:
            # count the __init__ only when a name comes from it (else assets/__init__ would tie every asset
            # to every other)
            if len(subs) < len(node.names) or not subs:
                out.add(base)
    # the engine registry finds its engines by name at run time (worker/engines/__init__.py: `get`): a module
    # that imports it may run any engine, every file of it (an engine's processes run some by module path)
    engines = f"{PACKAGE}.worker.engines"
    if engines in out and module != engines:
        for p in (root / "worker" / "engines").iterdir():
            if p.is_file() and p.suffix == ".py" and p.name != "__init__.py":
                out.add(f"{engines}.{p.stem}")
            elif (p / "__init__.py").is_file():
                out.update(f"{engines}.{p.name}" + ("" if f.name == "__init__.py" else f".{f.stem}")
                           for f in p.glob("*.py"))
    # this module only names versions: a change to it changes what they are computed from, not what runs
    return {m for m in out if m != __name__ and _path(root, m) is not None}


def closure(root: Path, modules: list[str]) -> set[str]:
    """`modules` and everything they import within the package, transitively."""
    seen, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(root, m) - seen)
    return seen


def stage_modules(root: Path = ROOT) -> dict[str, str]:
    """Stage name -> worker module, read from the registry's `STAGES = {"name": _lazy("module"), ...}`."""
    for node in _tree(_path(root, REGISTRY)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "STAGES" for t in node.targets):
            return {k.value: f"{PACKAGE}.worker.{v.args[0].value}" for k, v in zip(node.value.keys, node.value.values)}
    raise ValueError(f"no STAGES in {REGISTRY}")


def stages_run_by(root: Path, module: str, function: str) -> set[str]:
    """The stage names `function` of `module` passes to `run_stage`, itself or through the module-level
    functions it calls."""
    defs = {n.name: n for n in _tree(_path(root, module)).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if function not in defs:
        raise ValueError(f"{module} has no function {function!r}")
    stages, seen, todo = set(), set(), [function]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(defs[name]):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "run_stage" and len(node.args) >= 2:
                if not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                    raise ValueError(f"{module}.{name}: run_stage with a stage name that is not a literal")
                stages.add(node.args[1].value)
            elif isinstance(f, ast.Name) and f.id in defs:
                todo.append(f.id)
    return stages


def files_of(module: str, function: str, root: Path = ROOT) -> list[str]:
    """The package files (relative to the package) the asset `function` in `module` runs."""
    registry = stage_modules(root)
    stages = stages_run_by(root, module, function)
    unknown = stages - registry.keys()
    if unknown:
        raise ValueError(f"{module}.{function} runs stages not in {REGISTRY}: {sorted(unknown)}")
    # each stage's own contract (the entry point reads it by name: stages/__init__.py imports none of them)
    start = [module] + ([ENTRY] + [m for s in sorted(stages) for m in (registry[s], f"{CONTRACTS}.{s}")]
                        if stages else [])
    return sorted(str(_path(root, m).relative_to(root)) for m in closure(root, start))


@cache
def code_version(module: str, function: str, root: Path = ROOT) -> str:
    """12 hex digits of sha256 over the sorted (path, bytes) of `files_of(...)`; cached for the process."""
    h = hashlib.sha256()
    for rel in files_of(module, function, root):
        data = (root / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]
