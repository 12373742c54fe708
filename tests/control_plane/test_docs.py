"""The docs hold to the code: every run-config key a page shows is a setting of that asset, every hosts-file key
a field of its host's kind, every `eagle3-assets ...` command parses with the CLI's own parser, every
`python bench/...` script exists, every `eagle3_assets/...` path a page names exists, every name the page on
extending it shows is one the code defines, the concepts page names every job, sensor and schedule, the
environment-variable reference covers what the package reads, and the site builds offline with --strict."""

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REF = _reference()


def blocks(lang: str, pages=PAGES):
    """(page, line, text) of every fenced block of that language (indented ones too, as in list items)."""
    for page in pages:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group("lang") == lang:
                body = "\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines())
                yield page.relative_to(ROOT), text.count("\n", 0, m.start()) + 1, body


def run_config_errors(text: str, configs: dict) -> list[str]:
    """What in a YAML block is not a setting: an `ops:` asset that is not one, or a key its config lacks."""
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict) or "ops" not in doc:
        return []
    errors = []
    for asset, body in (doc["ops"] or {}).items():
        if asset not in configs:
            errors.append(f"ops.{asset}: not an asset with a run config ({sorted(configs)})")
            continue
        fields = configs[asset].model_fields
        errors += [f"ops.{asset}.config.{key}: not a setting of {asset}"
                   for key in ((body or {}).get("config") or {}) if key not in fields]
    return errors


def commands(text: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in re.split(r"&&|;|\|", line) if c.strip()]
    return out


def test_every_run_config_key_the_docs_show_is_a_setting():
    configs = REF.asset_configs()
    found, errors = 0, []
    for page, line, text in blocks("yaml"):
        errs = run_config_errors(text, configs)
        found += "ops" in (yaml.safe_load(text) or {})
        errors += [f"{page}:{line}: {e}" for e in errs]
    assert found >= 3, "the docs' run configs were not found: the block parser is broken"
    assert not errors, "\n".join(errors)


def hosts_file_errors(text: str) -> list[str]:
    """What in a hosts file (EAGLE3_HOSTS) is not a field of its host's kind."""
    from eagle3_assets.hosts.pool import KINDS

    doc = yaml.safe_load(text)
    if not isinstance(doc, dict) or "hosts" not in doc:
        return []
    errors = []
    for h in doc["hosts"]:
        kind = h.get("kind")
        if kind not in KINDS:
            errors.append(f"host {h.get('name')!r}: kind {kind!r} is not one of {sorted(KINDS)}")
            continue
        errors += [f"host {h.get('name')!r} ({kind}): {key} is not a field" for key in h
                   if key not in ("name", "kind", "storage") and key not in KINDS[kind].model_fields]
    return errors


def test_every_hosts_file_the_docs_show_has_real_fields():
    found, errors = 0, []
    for page, line, text in blocks("yaml"):
        found += "hosts" in (yaml.safe_load(text) or {})
        errors += [f"{page}:{line}: {e}" for e in hosts_file_errors(text)]
    assert found >= 2, "the docs' hosts files were not found: the block parser is broken"
    assert not errors, "\n".join(errors)
    assert hosts_file_errors("hosts:\n  - {name: a, kind: ssh, host: x, workdri: /w}\n") == \
        ["host 'a' (ssh): workdri is not a field"]


def test_a_misspelt_key_fails():
    configs = REF.asset_configs()
    good = "ops:\n  eagle3_drafter:\n    config: {epochs: 3, ttt_steps: 7}\n"
    assert run_config_errors(good, configs) == []
    assert run_config_errors(good.replace("ttt_steps", "tt_steps"), configs) == \
        ["ops.eagle3_drafter.config.tt_steps: not a setting of eagle3_drafter"]
    assert run_config_errors("ops:\n  eagle3_draftr: {config: {epochs: 3}}\n", configs)[0].startswith("ops.eagle3_draftr")


def test_every_command_the_docs_show_parses_and_every_bench_script_exists():
    parser = REF.cli_parser()
    parsed, errors = 0, []
    for page, line, text in blocks("bash"):
        for cmd in commands(text):
            words = shlex.split(cmd)
            if words[0] == "eagle3-assets":
                try:
                    parser.parse_args(words[1:])
                    parsed += 1
                except SystemExit:
                    errors.append(f"{page}:{line}: `{cmd}` does not parse with eagle3_assets/cli.py's parser")
            elif words[:1] == ["python"] and len(words) > 1 and words[1].startswith("bench/"):
                parsed += 1
                if not (ROOT / words[1]).is_file():
                    errors.append(f"{page}:{line}: `{cmd}`: no {words[1]}")
            elif words[:3] == ["python", "-m", "eagle3_assets.worker"] and len(words) > 3:
                from eagle3_assets import stages

                if words[3] not in stages.NAMES:
                    errors.append(f"{page}:{line}: `{cmd}`: no stage {words[3]}")
    assert parsed >= 10, "the docs' commands were not found: the block parser is broken"
    assert not errors, "\n".join(errors)


def test_a_command_that_does_not_parse_fails():
    parser = REF.cli_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(shlex.split("materialize --budget 30"))
    with pytest.raises(SystemExit):
        parser.parse_args(shlex.split("lineage --explain four"))


def test_every_page_the_readme_links_exists():
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    local = [link.split("#", 1)[0] for link in links if "://" not in link]
    assert len(local) >= 10, "the README's links were not found: the pattern is broken"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to what is not there: {missing}"


PACKAGE_PATH = re.compile(r"(?<![\w/.])eagle3_assets(?:/[\w.-]+)*/?")


def path_errors(text: str) -> list[str]:
    """The `eagle3_assets/...` paths in a page's text that are not in the repository. A path ends where a
    placeholder starts (`worker/engines/<name>/` is checked as `worker/engines/`); a sentence's full stop is not
    part of it."""
    errors = []
    for m in PACKAGE_PATH.finditer(text):
        path = m.group(0).rstrip(".")
        if not (ROOT / path).exists():
            errors.append(f"{path}: no such file or folder")
    return errors


def test_every_package_path_the_docs_name_exists():
    found, errors = 0, []
    for page in PAGES:
        text = page.read_text()
        found += len(PACKAGE_PATH.findall(text))
        errors += [f"{page.relative_to(ROOT)}: {e}" for e in path_errors(text)]
    assert found >= 40, "the docs' package paths were not found: the path pattern is broken"
    assert not errors, "\n".join(errors)


def test_a_moved_module_fails():
    assert path_errors("the loop: `eagle3_assets/loop/retrain.py`, `eagle3_assets/worker/engines/<name>/`.") == []
    assert path_errors("the old place: eagle3_assets/loop.py.") == ["eagle3_assets/loop.py: no such file or folder"]
    assert path_errors("eagle3_assets/assets/traffic.py") == ["eagle3_assets/assets/traffic.py: no such file or folder"]


def code_names() -> set[str]:
    """Every name the package and its tests define (functions, classes, assignments, fields, modules and packages)
    and every identifier-like string they hold (job and asset names, record keys)."""
    names = set()
    for path in [*(ROOT / "eagle3_assets").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        names.add(path.stem if path.name != "__init__.py" else path.parent.name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    return names


CODE_NAME = re.compile(r"`([A-Za-z_]\w*)`")


@pytest.mark.parametrize("page", ["extend.md", "glossary.md"])
def test_every_name_the_extension_page_and_the_glossary_show_is_in_the_code(page):
    """docs/extend.md tells what to touch by name (`to_messages`, `STAGES`, `engine_partitions`...), the glossary
    where a word lives: each name must still be defined in the package (or, for a test, in tests/), so a rename
    shows up here, not in a newcomer's search."""
    known = code_names()
    shown = set(CODE_NAME.findall((ROOT / "docs" / page).read_text()))
    assert len(shown) >= 30, "the page's names were not found: the pattern is broken"
    missing = sorted(shown - known)
    assert not missing, f"docs/{page} names what the code does not define: {missing}"
    assert "to_messages" in known and "to_" + "messagez" not in known  # (split: this file is read too)


def test_the_concepts_page_names_every_job_sensor_and_schedule():
    from eagle3_assets import eye, loop
    from eagle3_assets.definitions import defs
    from eagle3_assets.eye.servers_file import ServersFile

    # with a servers file, as production runs it: the live sensors exist only then
    servers = ServersFile.model_validate({"servers": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    parts = [defs, eye.definitions(servers), loop.definitions(servers)]
    jobs = {j.name for j in defs.resolve_all_job_defs() if not j.name.startswith("__")}
    jobs |= {j.name for d in parts for j in (d.jobs or [])}
    names = jobs | {s.name for d in parts for s in [*(d.sensors or []), *(d.schedules or [])]}
    assert {"retrain_on_traffic", "report_drift", "live_drift_sensor", "nightly_rebenchmark"} <= names
    page = (ROOT / "docs" / "concepts.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"docs/concepts.md (Jobs, sensors and schedules) does not name {missing}"


def test_the_environment_reference_covers_what_the_package_reads():
    found = REF.env_scan()
    listed = set(REF.ENV) | set(REF.INTERNAL)
    assert {"EAGLE3_SSH_KEY_FILE", "EAGLE3_K8S_PVC", "EAGLE3_HOSTS", "EAGLE3_CPU_BF16"} <= set(found)
    undescribed = set(found) - listed - set(REF.env_comments())
    assert not undescribed, f"read by the package, described neither in docs/hooks/reference.py nor by a comment " \
                            f"where defined: {sorted(undescribed)}"
    assert "undocumented" not in REF.environment_page()


@pytest.mark.slow
def test_the_site_builds_strict_and_offline(tmp_path):
    out = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for page in ("reference/settings", "reference/stages", "reference/metadata", "reference/cli",
                 "reference/environment", "reference/code"):
        assert (out / page / "index.html").is_file(), page
    settings = (out / "reference" / "settings" / "index.html").read_text()
    assert "ttt_steps" in settings and "time_budget_s" in settings
    # nothing a page loads comes from elsewhere (no web fonts, no CDN)
    for html in out.rglob("*.html"):
        fetched = re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', html.read_text())
        assert not fetched, f"{html.relative_to(out)} loads {fetched}"
