"""A stage on several processes of one host: it relaunches itself under torchrun (one process per GPU, or per
share of a CPU host's cores). Rank 0 reports as JSON lines on its stdout and the launching process, which holds
the Pipes connection and the output's lock, relays them, so Dagster sees one stage whatever the process count.
Used by data-parallel training (training/distributed.py) and the hf backend's split extraction
(hidden_states/ranks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from .errors import StageError
from .report import relayed

RELAY_ENV = "EAGLE3_REPORT_JSONL"


def launched() -> bool:
    """Whether this process is a rank that torchrun started for a launcher of ours."""
    return "RANK" in os.environ and os.environ.get(RELAY_ENV) == "1"


def run(stage: str, workdir: str, args_json: str, n: int, reporter, what: str,
        env: dict[str, str] | None = None) -> None:
    """`stage` on n processes; rank 0's reports relayed to `reporter`; a StageError naming `what` if any fails."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    child_env.update({RELAY_ENV: "1", **(env or {})})
    # the ranks read the arguments from an owner-only file (mkstemp: mode 600), never from their command lines
    with tempfile.NamedTemporaryFile("w", prefix=f"{stage}-args-", suffix=".json") as args_file:
        args_file.write(args_json)
        args_file.flush()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "-m", "eagle3_assets.worker", stage, "--workdir", workdir, "--args-file", args_file.name]
        reporter.log(f"launching {what} on {n} processes: {' '.join(cmd[:8])} ...")
        _relay(subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, text=True), reporter, what)


def _relay(proc: subprocess.Popen, reporter, what: str) -> None:
    error = failed = None
    for msg in relayed(proc.stdout):
        kind = msg.get("kind")
        if kind == "log":
            reporter.log(msg["message"], msg.get("level", "info"))
            if msg.get("level") == "error" and failed is None:  # the first rank to fail says why
                failed = msg["message"]
        elif kind == "materialize":
            reporter.materialize(msg["metadata"], msg.get("data_version"))
        elif kind == "result":
            reporter.result(msg["payload"])
        elif kind == "error":
            error = msg["message"]
    rc = proc.wait()
    if rc != 0 or error:
        raise StageError(error or failed or f"{what} exited with status {rc}")
