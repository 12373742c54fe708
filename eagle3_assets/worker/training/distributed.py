"""Data-parallel training on several GPUs of one host: the stage relaunches itself under torchrun, one
process per GPU (worker/torchrun.py), joined through accelerate."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .. import torchrun

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.train import TrainArgs


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
    """Run the `train` stage on n processes and relay rank 0's reports. torchrun starts the ranks; accelerate's
    PartialState (in Group) joins them into a process group on the right device and backend (NCCL on GPUs,
    gloo on CPU)."""
    rank_args = args.model_copy(update={"num_processes": 1}).model_dump_json()
    torchrun.run("train", workdir, rank_args, n, reporter, "data-parallel training")
