"""What the SSH host adds to a stage against the local host, on loopback (target: under 2 s per stage).

Starts a real sshd on 127.0.0.1 (the tests' `tests/ssh_server.py`), converts the embedded target once, then
materializes `target_model` on that converted directory (stage `prepare_target`: a short real stage, worker
start and all) `--repeat` times, alternating the local host and the SSH host, and compares their step times
(Dagster's STEP_START -> STEP_SUCCESS). The SSH host's own log line splits its part into connect, host
preflight (probe + worker-code check) and job start; the rest is following the job's messages to its end.

    python bench/ssh_overhead.py --repeat 5
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from eagle3_assets.definitions import all_assets  # noqa: E402
from eagle3_assets.hosts import LocalGpuHost, SshGpuHost  # noqa: E402
from ssh_server import SshServer  # noqa: E402

PHASES = re.compile(r"connected in ([\d.]+) s, host ready in ([\d.]+) s, job started in ([\d.]+) s")


def step_seconds(instance, run_id: str) -> float:
    times = {r.dagster_event.event_type_value: r.timestamp for r in instance.all_logs(run_id)
             if r.dagster_event is not None and r.dagster_event.event_type_value in ("STEP_START", "STEP_SUCCESS")}
    return times["STEP_SUCCESS"] - times["STEP_START"]


def phases(instance, run_id: str):
    for r in instance.all_logs(run_id):
        if r.dagster_event is None and (m := PHASES.search(r.user_message)):
            return [float(x) for x in m.groups()]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ssh_overhead.json"))
    ns = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ssh-bench-"))
    server = SshServer(root / "sshd").start()
    work = root / "work"
    local = LocalGpuHost(workdir=str(work))
    ssh = SshGpuHost(host="127.0.0.1", port=server.port, user=server.user, key_file=str(server.client_key),
                     known_hosts=str(server.known_hosts), python=sys.executable, workdir=str(work), require_gpus=False)
    try:
        with dg.instance_for_test() as instance:
            def run(host, path=None):
                cfg = {"ops": {"target_model": {"config": {"path": path}}}} if path else None
                res = dg.materialize(all_assets, selection=["target_model"], instance=instance,
                                     resources={"gpu_host": host}, run_config=cfg)
                assert res.success
                return res.run_id

            run(local)  # convert the embedded target once
            target = instance.get_latest_materialization_event(dg.AssetKey("target_model")) \
                .asset_materialization.metadata["path"].value
            first_s = step_seconds(instance, run(ssh, target))  # includes the one-off worker-code upload
            rows = {"local": [], "ssh": [], "ssh_phases": []}
            for _ in range(ns.repeat):
                rows["local"].append(step_seconds(instance, run(local, target)))
                rid = run(ssh, target)
                rows["ssh"].append(step_seconds(instance, rid))
                rows["ssh_phases"].append(phases(instance, rid))
    finally:
        server.stop()
    med = {k: statistics.median(rows[k]) for k in ("local", "ssh")}
    ph = [round(statistics.median(p[i] for p in rows["ssh_phases"]), 3) for i in range(3)]
    result = {
        "stage": "prepare_target (target_model on a converted directory)", "repeat": ns.repeat,
        "local_step_s": rows["local"], "ssh_step_s": rows["ssh"],
        "median_local_s": round(med["local"], 3), "median_ssh_s": round(med["ssh"], 3),
        "median_overhead_s": round(med["ssh"] - med["local"], 3),
        "first_ssh_step_s_with_code_upload": round(first_s, 3),
        "median_ssh_connect_s": ph[0], "median_ssh_host_ready_s": ph[1], "median_ssh_job_start_s": ph[2],
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
