"""The cost of one `traffic` partition: a day of gateway requests (gzip JSONL in 4 files, random words of the
shipped prompts, a tenth carrying personal data, a twentieth repeated, a few of the day before) materialized with
the shipped settings (max_prompts 1000) through the real `dagster asset materialize` on a fresh instance and the
local host, after `prompts`. Records the CLI's wall time, the step's (event log), and the control plane's
read-and-redact share.

    python bench/traffic_partition.py [--requests 20000]   # -> bench/results/traffic_partition.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

ROOT = Path(__file__).resolve().parents[1]
DAY = "2026-12-02"
START = 1796169600  # 2026-12-02T00:00:00Z
ASKS = ["Explain {t} to me.", "Write a short poem that uses the words {t}.", "Give me interview questions on {t}.",
        "Summarise, in bullet points: {t}."]
PII = [" My email is user{i}@example.org.", " Call me on +1 415 555 {p:04d}.", " The box is at 198.51.100.{o}.",
       " Card 4111 1111 1111 1111 was refused.", " My key sk-live{i:08d}AbCdEfGhIjKlMnOp leaked?"]


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def write_day(logs: Path, n: int) -> None:
    rng = random.Random(0)
    # words of the shipped prompts, drawn at random: requests as varied as a day's, few near duplicates by chance
    shipped = (ROOT / "eagle3_assets/datasets/bundled_prompts.jsonl").read_text()
    words = sorted({w for w in re.findall(r"[a-z]{4,}", shipped.lower())})
    rows = []
    for i in range(n):
        text = rng.choice(ASKS).format(t=" ".join(rng.choices(words, k=rng.randint(8, 60))))
        if i % 10 == 0:
            text += rng.choice(PII).format(i=i, p=i % 10000, o=i % 250)
        ts = START + rng.uniform(-600, 86400) if i % 50 else START - 3600  # a few of the day before
        rows.append({"timestamp": ts, "body": {"model": "served", "messages": [
            {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]}})
        if i % 20 == 0:
            rows.append(rows[-1])  # a retried request
    for k in range(4):
        with gzip.open(logs / f"gw-{DAY}-{k}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k::4])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ns = ap.parse_args()
    dagster = str(Path(sys.executable).with_name("dagster"))
    with tempfile.TemporaryDirectory() as tmp:
        home, work, logs = Path(tmp) / "home", Path(tmp) / "work", Path(tmp) / "logs"
        home.mkdir()
        logs.mkdir()
        write_day(logs, ns.requests)
        env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_HOST_WORKDIR": str(work),
               "EAGLE3_TRAFFIC_LOGS": str(logs / "*.jsonl.gz")}
        base = [dagster, "asset", "materialize", "-m", "eagle3_assets.definitions"]
        subprocess.run([*base, "--select", "prompts"], env=env, check=True, capture_output=True)
        t = time.monotonic()
        subprocess.run([*base, "--select", "traffic", "--partition", DAY], env=env, check=True, capture_output=True)
        wall = time.monotonic() - t
        with dg.DagsterInstance.from_config(str(home)) as instance:
            ev = instance.get_latest_materialization_event(dg.AssetKey("traffic"))
            meta = {k: v.value for k, v in ev.asset_materialization.metadata.items()}
            stats = instance.get_run_step_stats(ev.run_id)[0]
    out = {"cpu": _cpu(), "cores": os.cpu_count(), "requests_written": ns.requests, "cli_wall_s": round(wall, 1),
           "step_s": round(stats.end_time - stats.start_time, 1), **{k: meta[k] for k in (
               "requests_read", "requests_in_day", "exact_duplicates_dropped", "candidates_redacted", "prompts",
               "near_duplicates_within", "near_duplicates_of_held_out", "redacted_total", "redacted_email",
               "redacted_phone", "redacted_ip_address", "redacted_credit_card", "redacted_api_key",
               "read_and_redact_s")}}
    print(json.dumps(out, indent=2))
    (ROOT / "bench/results/traffic_partition.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
