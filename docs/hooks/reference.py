"""MkDocs hook: the reference pages, generated from the code at every build so that they cannot drift.

- reference/settings.md: every asset's run-config settings, from its Dagster config class (each inherits its
  stage's pydantic contract in eagle3_assets/stages/): name, type, default, bounds, description.
- reference/stages.md: every worker stage's arguments, as `python -m eagle3_assets.worker <stage> --help` prints them.
- reference/metadata.md: every asset's metadata keys, from the stages' Result models (what the other half reads)
  and a scan of the code that records the materialization.
- reference/cli.md: `eagle3-assets --help` and each subcommand's, from the CLI's own parser.
- reference/code.md: the map of the code, every module with the first line of its docstring.
- reference/environment.md: the environment variables the product reads, found by scanning the package's source,
  described here or by the comment where the code defines them (tests/control_plane/test_docs.py fails on one
  with neither).

tests/control_plane/test_docs.py imports this module for the same facts (asset configs, the parser, the scan).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3_assets"
PAGES = ("settings", "stages", "metadata", "cli", "environment", "code")


# --- assets and their settings ------------------------------------------------------------------------------

def assets() -> list[tuple[str, str, type | None, str, str]]:
    """(asset name, group, run-config class or None, module, function) for every asset of the code location, in
    its order."""
    import dagster as dg

    from eagle3_assets.definitions import defs

    out = []
    for a in defs.assets:
        fn = a.op.compute_fn.decorated_fn
        cfg = next((p.annotation for p in inspect.signature(fn).parameters.values()
                    if isinstance(p.annotation, type) and issubclass(p.annotation, dg.Config)), None)
        for key in a.keys:
            out.append((key.to_user_string(), a.group_names_by_key[key], cfg, fn.__module__, fn.__name__))
    return out


def asset_configs() -> dict[str, type]:
    """asset name -> its run-config class (a pydantic model): what `ops: {<asset>: {config: ...}}` takes."""
    return {name: cfg for name, _, cfg, _, _ in assets() if cfg is not None}


def _field_rows(model) -> list[tuple[str, str, str, str, str]]:
    from eagle3_assets.stages import _BOUNDS, _type_name  # the same rendering as the worker's --help

    rows = []
    for name, f in model.model_fields.items():
        default = "required" if f.is_required() else json.dumps(f.get_default(call_default_factory=True))
        bounds = ", ".join(f"{sym} {getattr(m, attr)}" for m in f.metadata for attr, sym in _BOUNDS.items()
                           if getattr(m, attr, None) is not None)
        rows.append((name, _type_name(f.annotation), default, bounds, f.description or ""))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_page() -> str:
    lines = ["# Settings of every asset", "",
             "Generated at build time from each asset's Dagster config class, which inherits its stage's pydantic "
             "contract (`eagle3_assets/stages/<stage>.py`): the launchpad, `eagle3-assets materialize --config` and "
             "the worker read the same fields, defaults and bounds. A run config sets them as",
             "", "```yaml", "ops:", "  <asset>:", "    config: {<setting>: <value>}", "```", "",
             "An unknown key is refused (the models forbid extra fields), naming it.", ""]
    for name, group, cfg, module, _ in assets():
        lines += [f"## `{name}`", "", f"Group `{group}`; config `{cfg.__name__}` (`{module}`)." if cfg else
                  f"Group `{group}`; no run config.", ""]
        if cfg is None:
            continue
        lines += ["| setting | type | default | bounds | description |", "|---|---|---|---|---|"]
        # the type as text: a `\|` inside a code span would show its backslash
        lines += [f"| `{n}` | {_cell(t)} | `{d}` | {_cell(b)} | {_cell(desc)} |" if "|" not in d else
                  f"| `{n}` | {_cell(t)} | {_cell(d)} | {_cell(b)} | {_cell(desc)} |"
                  for n, t, d, b, desc in _field_rows(cfg)]
        lines.append("")
    return "\n".join(lines)


def stages_page() -> str:
    from eagle3_assets import stages

    lines = ["# Worker stages and their arguments", "",
             "Generated at build time from `eagle3_assets/stages/`: what `python -m eagle3_assets.worker <stage> "
             "--help` prints. The asset fills in the host paths; the worker checks every argument before it "
             "imports torch. Run a stage by hand with `python -m eagle3_assets.worker <stage> --workdir DIR "
             "--args '{...}'`.", ""]
    for stage in stages.NAMES:
        doc = (importlib.import_module(f"eagle3_assets.stages.{stage}").__doc__ or "").strip().splitlines()
        lines += [f"## `{stage}`", "", doc[0] if doc else "", "", "```text", stages.describe(stage), "```", ""]
    return "\n".join(lines)


# --- metadata keys -------------------------------------------------------------------------------------------

def _key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<" + ast.unparse(v.value) + ">"
                       for v in node.values)
    return None


def _dict_keys(node: ast.AST, keys: list[str], spread: list[str]) -> None:
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if k is None:
                if isinstance(v, ast.Dict):
                    _dict_keys(v, keys, spread)
                else:
                    spread.append(ast.unparse(v))
            elif (name := _key(k)) is not None:
                keys.append(name)
    elif isinstance(node, ast.DictComp) and (name := _key(node.key)):
        keys.append(name)


def _recorded_keys(path: Path, call: str, only: str | None = None) -> tuple[list[str], list[str]]:
    """Keys of the metadata a module records through `<x>.<call>(metadata=...)` (or MaterializeResult(metadata=)):
    a dict literal, or a name the same function builds as a dict and fills by subscript or update."""
    tree = ast.parse(path.read_text())
    keys: list[str] = []
    spread: list[str] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or only and fn.name != only:
            continue
        for c in ast.walk(fn):
            if not (isinstance(c, ast.Call) and getattr(c.func, "attr", getattr(c.func, "id", None)) == call):
                continue
            for kw in c.keywords:
                if kw.arg != "metadata":
                    continue
                if isinstance(kw.value, ast.Name):
                    _named_dict_keys(fn, kw.value.id, keys, spread)
                else:
                    _dict_keys(kw.value, keys, spread)
    return list(dict.fromkeys(keys)), list(dict.fromkeys(spread))


def _named_dict_keys(fn: ast.AST, var: str, keys: list[str], spread: list[str]) -> None:
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id == var:
                    _dict_keys(n.value, keys, spread) if isinstance(n.value, (ast.Dict, ast.DictComp)) \
                        else spread.append(ast.unparse(n.value))
                elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == var:
                    if (name := _key(t.slice)) is not None:
                        keys.append(name)
        elif (isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "update"
              and isinstance(n.func.value, ast.Name) and n.func.value.id == var):
            for a in n.args:
                _dict_keys(a, keys, spread) if isinstance(a, ast.Dict) else spread.append(ast.unparse(a))
            keys += [kw.arg for kw in n.keywords if kw.arg]


def _worker_modules() -> dict[str, Path]:
    """stage -> the worker module that runs it (worker/stages.py's registry, read without importing the worker)."""
    text = (PACKAGE / "worker" / "stages.py").read_text()
    return {stage: PACKAGE / "worker" / (mod.replace(".", "/") + ".py")
            for stage, mod in re.findall(r'"(\w+)": _lazy\("([\w.]+)"\)', text)}


def _stages_run(module: str) -> list[str]:
    tree = ast.parse(Path(importlib.import_module(module).__file__).read_text())
    return list(dict.fromkeys(c.args[1].value for c in ast.walk(tree) if isinstance(c, ast.Call)
                              and getattr(c.func, "attr", None) == "run_stage" and len(c.args) > 1
                              and isinstance(c.args[1], ast.Constant)))


def metadata_page() -> str:
    from eagle3_assets import stages
    from eagle3_assets.stages import _type_name

    workers = _worker_modules()
    lines = ["# Metadata of every asset", "",
             "Generated at build time. **Guaranteed** keys are the stage's `Result` model "
             "(`eagle3_assets/stages/<stage>.py`): the worker checks them before it reports, and the other half reads "
             "them. **Recorded** keys are what a scan of the recording code finds (`<name>` marks a key made per "
             "value, e.g. per concurrency or per unroll position); *merged from* names the dicts whose keys are "
             "added at run time (the CPU probe, an engine's facts). The UI shows them on each materialization.", ""]
    for name, _, _, module, fn in assets():
        lines += [f"## `{name}`", ""]
        run = _stages_run(module)
        own, own_spread = _recorded_keys(Path(importlib.import_module(module).__file__), "MaterializeResult", fn)
        for stage in run:
            c = stages.contract(stage)
            model = c.metadata or c.result
            if model is not None and model.model_fields:
                kind = "metadata" if c.metadata else "result"
                lines.append(f"Guaranteed by stage `{stage}` ({kind} model `{model.__name__}`): " + ", ".join(
                    f"`{k}` ({_type_name(f.annotation)})" for k, f in model.model_fields.items()) + ".")
                lines.append("")
            if stage in workers and not own:
                keys, spread = _recorded_keys(workers[stage], "materialize")
                if keys:
                    rel = workers[stage].relative_to(ROOT)
                    lines += [f"Recorded by stage `{stage}` (`{rel}`): " + ", ".join(f"`{k}`" for k in keys)
                              + (f"; merged from {', '.join(f'`{s}`' for s in spread)}" if spread else "") + ".", ""]
        if own:
            lines += [f"Recorded by the asset (`{module}`): " + ", ".join(f"`{k}`" for k in own)
                      + (f"; merged from {', '.join(f'`{s}`' for s in own_spread)}" if own_spread else "") + ".", ""]
    return "\n".join(lines)


# --- the CLI -------------------------------------------------------------------------------------------------

def cli_parser():
    from eagle3_assets.cli import parser

    return parser()


def cli_page() -> str:
    import argparse

    ap = cli_parser()
    lines = ["# The `eagle3-assets` command", "", "Generated at build time from `eagle3_assets/cli.py`'s parser.", "",
             "```text", ap.format_help().rstrip(), "```", ""]
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        lines += [f"## `eagle3-assets {name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


# --- environment variables -----------------------------------------------------------------------------------

# What each variable the scan finds means. Product settings a user sets; then what the product sets for its own
# child processes, and what other tools set, both read but not for a user to set. Only the variables the scan
# finds are shown: an entry ahead of its code (or left after it) shows nothing.
ENV = {
    "DAGSTER_HOME": "the Dagster instance (runs, lineage, schedules); the CLI defaults it to ./dagster_home",
    "EAGLE3_HOST_WORKDIR": "the local host's work directory (default `$DAGSTER_HOME/host-work`)",
    "EAGLE3_HOSTS": "a hosts file (YAML): `gpu_host` becomes a pool of local, SSH and k8s hosts",
    "EAGLE3_SSH_HOST": "makes `gpu_host` the SSH host: the GPU machine's address",
    "EAGLE3_SSH_PORT": "its sshd port (default 22)",
    "EAGLE3_SSH_USER": "the user to log in as",
    "EAGLE3_SSH_KEY_FILE": "the private key's path (a path, never the key's text)",
    "EAGLE3_SSH_KEY_PASSPHRASE": "the key's passphrase, for an encrypted key (read when a run starts)",
    "EAGLE3_SSH_PASSWORD": "a password, instead of a key",
    "EAGLE3_SSH_KNOWN_HOSTS": "the known_hosts file host keys are checked against (default `~/.ssh/known_hosts`)",
    "EAGLE3_SSH_PYTHON": "the host's Python, with the worker's dependencies",
    "EAGLE3_SSH_WORKDIR": "the host's work directory: models, shards, checkpoints (required with EAGLE3_SSH_HOST)",
    "EAGLE3_SSH_CODE": "`upload` (default: the control plane's worker code, once per version) or `installed`",
    "EAGLE3_SSH_REQUIRE_GPUS": "`0`: a CPU-only host (GPU stages do not require nvidia-smi)",
    "EAGLE3_SSH_ACCEPT_UNKNOWN_HOST_KEY": "`1`: accept a host key not in known_hosts (logged with its fingerprint; avoid)",
    "EAGLE3_K8S_IMAGE": "makes `gpu_host` the Kubernetes host: the worker image",
    "EAGLE3_K8S_NAMESPACE": "the namespace the stage pods run in",
    "EAGLE3_K8S_PVC": "the ReadWriteMany PersistentVolumeClaim mounted at the workdir",
    "EAGLE3_K8S_WORKDIR": "where the PVC is mounted in every pod",
    "EAGLE3_K8S_GPUS": "nvidia.com/gpu requested by each GPU stage's pod",
    "EAGLE3_K8S_PYTHON": "the image's Python",
    "EAGLE3_K8S_SERVICE_ACCOUNT": "the pods' service account",
    "EAGLE3_K8S_KUBECONFIG": "the kubeconfig the control plane uses (default `~/.kube/config`)",
    "EAGLE3_K8S_KUBE_CONTEXT": "its context",
    "EAGLE3_K8S_CONTROL_PLANE_MOUNT": "the same PVC mounted on the Dagster machine (prompts and copies go through it)",
    "EAGLE3_K8S_SECRETS": "Secret names, comma-separated: each key becomes an environment variable of the pods",
    "EAGLE3_BENCH_CRON": "the `nightly_rebenchmark` schedule's cron (default `0 3 * * *`)",
    "EAGLE3_BENCH_ENGINES": "the engines it re-measures, comma-separated (default `vllm`)",
    "EAGLE3_BENCH_CONFIG": "a run-config YAML for the re-benchmark's settings",
    "EAGLE3_REGRESSION_ACCEPTANCE_DROP": "the regression sensor's threshold on acceptance length (default 0.05)",
    "EAGLE3_REGRESSION_SPEEDUP_DROP": "its threshold on speedup (default 0.10)",
    "EAGLE3_CPU_BF16": "`0` / `1`: overrides the CPU probe's bf16 answer (float32 everywhere with `0`)",
    "EAGLE3_CACHE": "where converted embedded targets are kept per machine (default `~/.cache/eagle3-assets`)",
    "EAGLE3_ENGINE_CHECK_CACHE": "where an engine's yes is kept per install (a directory, or `0` to probe every time)",
    "EAGLE3_OUTPUT_LOCK_WAIT_S": "how long a second worker for the same output waits for the first before refusing",
    "EAGLE3_TRAIN_EAGER": "`1`: train on a GPU with the dense eager path (no FlexAttention, no compile)",
    "EAGLE3_TRAIN_COMPILE": "`0`: no torch.compile in GPU training",
    "EAGLE3_INTEGRATION_GATE": "`require` or `skip`: this deployment's default of `eagle3_drafter`'s `integration_gate`",
    "EAGLE3_TRAFFIC_LOGS": "the serving-traffic log sources when the config names none: comma-separated paths, URLs, globs",
    "EAGLE3_TRAFFIC_START": "the first day a traffic backfill can ask for (read as the code location loads)",
    "EAGLE3_TRAFFIC_TIMEZONE": "where the traffic partitions' days begin (default UTC)",
    "EAGLE3_SERVERS": "a YAML file of the production servers whose acceptance the serving eye reads (each with its "
                      "engine and, where the server does not tell, the drafter it serves)",
}
INTERNAL = {
    "EAGLE3_REPORT_JSONL": "set by the product: a rank under torchrun reports as JSON lines its launcher relays",
    "EAGLE3_DIE_WITH_PARENT": "set by the local host: the pid a worker must not outlive",
    "EAGLE3_NO_BAR": "set by the SSH host's jobs: no terminal progress bar",
    "EAGLE3_EXTRACT_TMP": "set by the split hf extraction: the shard's temporary directory the ranks write into",
    "RANK": "set by torchrun", "WORLD_SIZE": "set by torchrun", "LOCAL_RANK": "set by torchrun",
    "CUDA_VISIBLE_DEVICES": "the GPUs a process sees (read to count them; `-1` or empty: none)",
    "PYTHONPATH": "extended for engine subprocesses with the worker's code",
    "XDG_CACHE_HOME": "the cache root when EAGLE3_ENGINE_CHECK_CACHE is unset",
    "DAGSTER_PIPES_CONTEXT": "set by Dagster Pipes when a stage runs under Dagster",
}

_READ = re.compile(r"""os\.environ(?:\.get)?[\[(]\s*["']([A-Z][A-Z0-9_]*)["']|os\.getenv\(\s*["']([A-Z][A-Z0-9_]*)["']"""
                   r"""|["']([A-Z][A-Z0-9_]*)["']\s+(?:not\s+)?in\s+os\.environ|["'](EAGLE3_[A-Z0-9_]*[A-Z0-9])["']""")


def _prefixed(tree: ast.Module) -> dict[str, list[str]]:
    """The EAGLE3_<PREFIX>_<KEY> families read by f-string: the module's dict constants name their keys."""
    return {t.id: list(ast.literal_eval(n.value)) for n in tree.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Dict)
            and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in n.value.keys)}


def env_comments() -> dict[str, str]:
    """A variable's description where the code defines it: `NAME_ENV = "EAGLE3_X"  # what it does`."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for m in re.finditer(r'^\w+ = "([A-Z][A-Z0-9_]*)"\s+#\s*(.+)$', path.read_text(), re.M):
            out.setdefault(m.group(1), m.group(2).strip())
    return out


def env_scan() -> dict[str, list[str]]:
    """Every environment variable the package reads or names: name -> ["file:line", ...]."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        for i, line in enumerate(text.splitlines(), 1):
            for m in _READ.finditer(line):
                found.setdefault(next(g for g in m.groups() if g), []).append(f"{rel}:{i}")
        # f"EAGLE3_SSH_{k}" for k in SSH_ENV: the dict's keys name the variables
        dicts = _prefixed(ast.parse(text)) if 'f"EAGLE3_' in text else {}
        for m in re.finditer(r'f"(EAGLE3_[A-Z0-9]+_)\{k\}"[\s\S]{0,300}?\bin\s+(\w+)\.items\(\)', text):
            line = text.count("\n", 0, m.start()) + 1
            for k in dicts.get(m.group(2), []):
                found.setdefault(m.group(1) + k, []).append(f"{rel}:{line}")
    return found


def environment_page() -> str:
    found = env_scan()
    # a variable added since this list was written: described by its comment where the code defines it, else
    # listed as undocumented (tests/control_plane/test_docs.py fails on it)
    comments = env_comments()
    later = {n: comments.get(n, "**undocumented**: describe it in docs/hooks/reference.py or where it is defined")
             for n in sorted(set(found) - set(ENV) - set(INTERNAL))}
    lines = ["# Environment variables", "",
             "Generated at build time by scanning `eagle3_assets/` for the variables it reads; each is listed with "
             "where. Set them where the Dagster processes start (the shell of `dagster dev` or `eagle3-assets "
             "materialize`, or a `.env` file beside `workspace.yaml`); the SSH host's are read when a run starts.", "",
             "## What you set", "", "| variable | what it does | read in |", "|---|---|---|"]
    for name, what in {**ENV, **later}.items():
        if name in found:
            lines.append(f"| `{name}` | {_cell(what)} | {', '.join(f'`{w}`' for w in found[name][:3])} |")
    lines += ["", "## What the product or other tools set", "",
              "Read by the product, set for its own processes or by torchrun, Dagster and the system: not for you "
              "to set.", "", "| variable | what it is | read in |", "|---|---|---|"]
    for name in INTERNAL:
        if name in found:
            lines.append(f"| `{name}` | {_cell(INTERNAL[name])} | {', '.join(f'`{w}`' for w in found[name][:3])} |")
    return "\n".join(lines) + "\n"


# --- the map of the code ------------------------------------------------------------------------------------

def code_page() -> str:
    lines = ["# Map of the code", "",
             "Generated at build time: every module of `eagle3_assets/` with the first sentence of its docstring. "
             "The control plane is everything but `worker/`, `stages/` and `common/`; the worker is `worker/`; "
             "`stages/` (the contracts) and `common/` (standard library only) are what both halves read "
             "([Concepts](../concepts.md#control-plane-and-worker)).", ""]
    folder = None
    for path in sorted(PACKAGE.rglob("*.py"), key=lambda p: (p.parent.relative_to(PACKAGE).parts, p.name)):
        if path.parent != folder:
            folder = path.parent
            lines += ["", f"## `{folder.relative_to(ROOT).as_posix()}/`", ""]
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].split())
        first = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0]
        lines.append(f"- `{path.name}`" + (f": {_cell(first)}" if first else ""))
    return "\n".join(lines) + "\n"


# --- the hook ------------------------------------------------------------------------------------------------

def on_files(files, config):
    from mkdocs.structure.files import File

    for page in PAGES:
        files.append(File.generated(config, f"reference/{page}.md", content=globals()[f"{page}_page"]()))
    return files
