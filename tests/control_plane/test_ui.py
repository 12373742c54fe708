"""The UI as a person uses it: `dagster dev -w workspace.yaml`, headless Chromium (Debian's) driven by
Playwright. Sees every asset, materializes a cheap one from its page, waits for the run, reads its metadata."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from eagle3_assets.definitions import defs

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists() and os.environ.get("CI") != "true",
                                reason="Debian's chromium is not installed (CI installs it and runs this)")]
# What a browser needs on a machine with no network and no GPU.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    home = tmp_path_factory.mktemp("ui_home")
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_HOST_WORKDIR": str(home / "host-work")}
    dagster = Path(sys.executable).with_name("dagster")
    proc = subprocess.Popen([str(dagster), "dev", "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, env=env, stdout=open(home / "dagster_dev.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                data = requests.post(f"{base}/graphql", json={"query": "{ assetNodes { id } }"}, timeout=10).json()
                if data.get("data", {}).get("assetNodes"):
                    break
            except (requests.ConnectionError, ValueError):
                pass
            time.sleep(1)
        else:
            log = (home / "dagster_dev.log").read_text()[-3000:]
            raise AssertionError(f"dagster dev did not serve the code location:\n{log}")
        yield base, home
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1600, "height": 1000})
        pg.set_default_timeout(60_000)
        yield pg
        pg.screenshot(path=str(tmp_path / "last.png"))  # what the page showed, when a step fails
        browser.close()


def _dismiss_welcome(pg) -> None:
    """Dagster's first-visit community dialog covers the page; a person would press Skip."""
    try:
        pg.get_by_role("button", name="Skip").click(timeout=5000)
    except Exception:  # not shown (already dismissed in this browser profile)
        pass


def test_the_catalog_shows_every_asset(ui, page):
    base, _ = ui
    page.set_viewport_size({"width": 1600, "height": 2400})  # the catalog draws only the rows in view: all of them
    page.goto(f"{base}/assets", wait_until="networkidle")
    _dismiss_welcome(page)
    names = sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())
    assert names == sorted(["host_preflight", "target_model", "prompts", "synthetic_prompts", "conversations",
                            "hidden_state_shards",
                            "vocab_mapping", "eagle3_drafter", "drafter_export", "offline_acceptance",
                            "speculation_schedule", "serving_benchmark", "benchmark_history", "benchmark_regression",
                            "integration_drafter", "integration_check", "traffic", "traffic_acceptance",
                            "drift_report", "retrain_data", "retrain_conversations", "retrain_shards",
                            "challenger_drafter", "challenger_export", "promotion_gate", "challenger_schedule",
                            "production_drafter", "rollout"])
    for name in names:
        page.get_by_text(name, exact=True).first.wait_for()


def test_materialize_a_cheap_asset_from_its_page_and_read_its_metadata(ui, page):
    base, _ = ui
    page.goto(f"{base}/assets/host_preflight", wait_until="networkidle")
    _dismiss_welcome(page)
    page.locator("button", has_text=re.compile(r"^\W*Materialize$")).first.click()
    toast = page.get_by_text(re.compile(r"Launched run \w+"))
    toast.wait_for()
    run_id = toast.inner_text().split()[-1]
    page.goto(f"{base}/runs", wait_until="networkidle")  # the run, in the runs list
    deadline = time.monotonic() + 180
    while not page.get_by_text("Success", exact=True).count():
        assert time.monotonic() < deadline, "the run launched from the UI did not succeed in 3 minutes"
        page.wait_for_timeout(2000)
        page.reload(wait_until="networkidle")
    page.get_by_text(run_id).first.wait_for()
    page.goto(f"{base}/assets/host_preflight", wait_until="networkidle")
    page.get_by_text("Events", exact=True).first.click()  # the materialization and its metadata
    for label in ("free_disk_gb", "python", "worker_deps", "gpu_count"):
        page.get_by_text(label, exact=True).first.wait_for()


def test_the_asset_graph_page_as_the_docs_show_it(ui, page, tmp_path):
    """The docs' picture of the UI is this page, taken here: EAGLE3_DOCS_SCREENSHOTS=1 writes it into docs/images/
    (commit the result); otherwise it goes to the test's temporary directory."""
    base, _ = ui
    page.set_viewport_size({"width": 2000, "height": 1100})
    page.goto(f"{base}/asset-groups", wait_until="networkidle")
    _dismiss_welcome(page)
    page.get_by_text("Hide navigation", exact=True).click()
    page.get_by_text("drafter", exact=True).first.wait_for()  # the groups, drawn collapsed
    page.locator("body").click(position={"x": 900, "y": 800})  # focus the graph, then its "Expand all groups" key
    page.keyboard.press("Alt+KeyE")
    # the graph opens on its upper left and draws only the nodes in view (long names are cut)
    for name in ("target_model", "prompts", "offline_acceptance", "drafter_export"):
        page.get_by_text(name, exact=True).first.wait_for()
    page.wait_for_timeout(2000)
    page.mouse.move(1100, 600)  # the graph opens zoomed in past the window: out, by ctrl+wheel as a person would
    page.keyboard.down("Control")
    page.mouse.wheel(0, 40)
    page.keyboard.up("Control")
    page.wait_for_timeout(1500)
    out = ROOT / "docs" / "images" if os.environ.get("EAGLE3_DOCS_SCREENSHOTS") == "1" else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / "ui-asset-graph.png"))
    assert (out / "ui-asset-graph.png").stat().st_size > 10_000
