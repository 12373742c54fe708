"""The serving eye as the UI shows it: the live acceptance series of a production server (its Plots tab, the live
figure beside the benchmarked one), its live check's history, and the newest drift report, each a screenshot from
headless Chromium against `dagster-webserver` on an instance that watched a server (tests/serving/test_serving_eye.py
leaves one under pytest's temporary directory: production0/dagster_home and production0/servers.yaml).

    python bench/serving_eye_ui.py --home /tmp/pytest-of-root/pytest-N/production0/dagster_home \\
        --servers /tmp/pytest-of-root/pytest-N/production0/servers.yaml --server prod --out docs/images

Also prints the series (time, status, acceptance length, steps) and writes it beside the images as JSON."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def series(home: str, server: str) -> list[dict]:
    os.environ["DAGSTER_HOME"] = home
    import dagster as dg

    from eagle3_assets.eye import served

    with dg.DagsterInstance.get() as instance:
        return [{k: o.get(k) for k in ("t", "status", "acceptance_length", "num_drafts", "benchmark_acceptance_length")}
                for o in served.observations(instance, server)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--server", default="prod")
    ap.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = series(args.home, args.server)
    for p in points:
        print(f"{time.strftime('%H:%M:%S', time.gmtime(p['t']))}  {p['status'][:40]:40}  "
              f"AL {p['acceptance_length'] or '-'}  steps {p['num_drafts'] or '-'}")
    (out / "serving-eye-series.json").write_text(json.dumps(points, indent=1))  # kept: bench/results/serving_eye_series.json

    port = _port()
    env = {**os.environ, "DAGSTER_HOME": args.home, "EAGLE3_SERVERS": args.servers}
    web = Path(sys.executable).with_name("dagster-webserver")
    proc = subprocess.Popen([str(web), "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(180):
            try:
                if requests.get(f"{base}/server_info", timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                        args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1100})
            page.set_default_timeout(60_000)
            for name, url in (("serving-eye-live-overview", f"/assets/live_acceptance/{args.server}"),  # its plots
                              ("serving-eye-live-checks", f"/assets/live_acceptance/{args.server}?view=checks"),
                              ("serving-eye-drift-report", "/assets/drift_report")):
                page.goto(base + url, wait_until="networkidle")
                try:  # Dagster's first-visit community dialog: a person would press Skip
                    page.get_by_role("button", name="Skip").click(timeout=5000)
                except Exception:  # noqa: BLE001 - not shown
                    pass
                page.wait_for_timeout(3000)
                if name == "serving-eye-live-overview":  # the Metadata section's plots: each number over time
                    page.get_by_role("button", name="Plots").click()
                    page.wait_for_timeout(4000)
                page.screenshot(path=str(out / f"{name}.png"), full_page=True)
                print(f"wrote {out / name}.png")
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
