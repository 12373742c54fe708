"""A traffic glob in a directory the Dagster user can list but not search (mode 0444: no x bit) matches nothing, as
glob() sees it; the user is told which directory to open up, not that the glob "matches no file" (issue 58).

The tests run as root, for whom permission bits are not enforced: the glob is expanded in a process run as `nobody`
(setpriv, as tests/serving/test_eye_faults.py does); run as another user, they expand it in a plain subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(ROOT and not shutil.which("setpriv"),
                                reason="needs setpriv to expand the glob as a user other than root")
PROBE = ("import json, sys\nfrom eagle3_assets.sources.gateway_logs import expand, TrafficError\n"
         "try:\n    print(json.dumps({'files': expand([sys.argv[1]])}))\n"
         "except TrafficError as e:\n    print(json.dumps({'error': str(e)}))\n")


def _expand_as_user(source: str, home: Path) -> dict:
    """expand([source]) in a process of a user without root's powers: its files, or its error's text."""
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if ROOT else []
    done = subprocess.run([*user, sys.executable, "-c", PROBE, source], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(home)}, cwd=str(home))
    assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def logs():
    root = Path(tempfile.mkdtemp(dir="/tmp"))  # not pytest's tmp_path: its parents are root's own (mode 0700)
    root.chmod(0o755)
    for day in ("logs", "daily/2026-12-02"):
        (root / day).mkdir(parents=True)
        (root / day / "gateway-2026-12-02.jsonl").write_text("{}\n")
    yield root
    for d in (root / "logs", root / "daily" / "2026-12-02"):
        d.chmod(0o755)
    shutil.rmtree(root)


@pytest.mark.parametrize("glob, locked", [("logs/gateway-*.jsonl", "logs"),
                                          ("daily/*/gateway-*.jsonl", "daily/2026-12-02"),
                                          ("daily/**/gateway-*.jsonl", "daily/2026-12-02")])
def test_a_glob_in_a_directory_that_can_be_listed_but_not_searched_says_permission_denied(logs, glob, locked):
    assert _expand_as_user(str(logs / glob), logs) == {"files": [str(logs / locked / "gateway-2026-12-02.jsonl")]}
    (logs / locked).chmod(0o444)  # listable (r), not searchable (no x): the file's name is seen, never its entry
    error = _expand_as_user(str(logs / glob), logs)["error"]
    assert f"permission denied: {logs / locked} cannot be searched (mode 0444)" in error, error
    assert "read and execute (search) permission" in error and "matches no file" not in error


def test_a_glob_that_truly_matches_nothing_still_says_so(logs):
    for glob in ("logs/other-*.jsonl", "absent/gateway-*.jsonl"):
        error = _expand_as_user(str(logs / glob), logs)["error"]
        assert "matches no file" in error and "permission denied" not in error, error
