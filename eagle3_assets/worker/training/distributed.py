"""Data-parallel training on several GPUs of one host: the stage relaunches itself under torchrun, one
process per GPU, joined through accelerate. Rank 0 reports as JSON lines on its stdout and the launching
process, which holds the Pipes connection, relays them, so Dagster sees one stage whatever the GPU count."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import torch

from ..errors import StageError
from ..report import relayed

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.train import TrainArgs

RELAY_ENV = "EAGLE3_REPORT_JSONL"


class Group:
    """This process's place among the data-parallel ranks (a group of one when not launched distributed)."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if self.world > 1:
            from accelerate import PartialState

            state = PartialState(cpu=device == "cpu")  # sets up the process group from torchrun's env
            self.device = str(state.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_grads(self, params) -> None:
        """Average gradients over ranks in one collective."""
        if self.world == 1:
            return
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        o = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[o: o + n].view_as(p).clone()
            o += n

    def sum(self, x: float) -> float:
        return self._reduce(x, "SUM")

    def max(self, x: float) -> float:
        return self._reduce(x, "MAX")

    def _reduce(self, x: float, op: str) -> float:
        if self.world == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return float(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def launch(workdir: str, args: TrainArgs, reporter, n: int) -> None:
    """Run the `train` stage on n processes and relay rank 0's reports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    env[RELAY_ENV] = "1"
    # torchrun starts the ranks; accelerate's PartialState (in Group) joins them into a process group on the
    # right device and backend (NCCL on GPUs, gloo on CPU).
    rank_args = args.model_copy(update={"num_processes": 1}).model_dump_json()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "eagle3_assets.worker", "train", "--workdir", workdir, "--args", rank_args]
    reporter.log(f"launching data-parallel training on {n} processes: {' '.join(cmd[:8])} ...")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    error = None
    for msg in relayed(proc.stdout):
        kind = msg.get("kind")
        if kind == "log":
            reporter.log(msg["message"], msg.get("level", "info"))
        elif kind == "materialize":
            reporter.materialize(msg["metadata"], msg.get("data_version"))
        elif kind == "result":
            reporter.result(msg["payload"])
        elif kind == "error":
            error = msg["message"]
    rc = proc.wait()
    if rc != 0 or error:
        raise StageError(error or f"data-parallel training exited with status {rc}")
