"""Training checkpoints written while training goes on.

A save copies the training state to host memory (the only part the step loop waits for: a few hundred ms
for an 8B target's drafter, against seconds to serialise and write it) and a thread writes it. Publishing
is as atomic as before: the directory is written under a temporary name, moved into place, and only then
does latest.json name it, so a kill at any moment leaves latest.json naming a complete checkpoint (the
previous one while a write is under way), and a resume from it replays the same steps to the same weights.
One write at a time: the next save, and the end of training, wait for the one in flight.
"""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path

import torch

from ..files import replace_dir, write_json


def _to_host(x, pinned: bool):
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":
            return x.detach().clone()
        dst = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinned)
        return dst.copy_(x.detach(), non_blocking=pinned)
    if isinstance(x, dict):
        return {k: _to_host(v, pinned) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v, pinned) for v in x)
    return copy.deepcopy(x)


def snapshot(model, opt, sched, state: dict) -> dict:
    """The training state as host copies (training then changes the originals in place)."""
    cuda = any(p.is_cuda for p in model.parameters())
    snap = _to_host({"model": {k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")},
                     "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, pinned=cuda)
    if cuda:
        torch.cuda.synchronize()  # the pinned copies are complete
    return {**snap, "rng": torch.get_rng_state(), **copy.deepcopy(state)}


def write_checkpoint(ckpt_dir: Path, snap: dict) -> None:
    tmp = ckpt_dir.with_name(f".tmp-{ckpt_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(snap, tmp / "training_state.pt")
    replace_dir(tmp, ckpt_dir)
    write_json(ckpt_dir.parent / "latest.json",
               {"checkpoint": ckpt_dir.name, **{k: snap[k] for k in ("step", "epoch", "fingerprint")}})
    for old in ckpt_dir.parent.glob("step-*"):  # only the latest is needed to resume
        if old.name != ckpt_dir.name:
            shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, ckpt_dir: Path, model, opt, sched, state: dict) -> None:
        self.wait()
        snap = snapshot(model, opt, sched, state)
        # not a daemon: an interpreter that exits (a failed run too) still finishes the write in flight
        self._thread = threading.Thread(target=self._write, args=(ckpt_dir, snap), name="checkpoint-writer")
        self._thread.start()

    def _write(self, ckpt_dir: Path, snap: dict) -> None:
        try:
            write_checkpoint(ckpt_dir, snap)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Until the write in flight is published; re-raises its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
