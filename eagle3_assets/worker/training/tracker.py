"""Training curves for an experiment tracker, beside the metadata Dagster plots: one small interface
(`scalars`, `close`), a no-op default and TensorBoard (`tracker: tensorboard`, the `tensorboard` extra).

The reporter holds the tracker, so a stage reports a figure once and it goes wherever the run is watched.
Another tracker (wandb, mlflow) is one more class here and one more name in stages/train.py's `tracker`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import StageError


class Tracker:
    """Records nothing: the default."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Event files under `log_dir` (`tensorboard --logdir <out>/tensorboard`). A resumed run purges the events
    past its resume step, so the curve is the one the weights went through, not two overlapping ones."""

    def __init__(self, log_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise StageError(f"tracker tensorboard needs the tensorboard package on the host ({e}): "
                             "pip install 'eagle3-assets[tensorboard]', or set tracker: none") from None
        self.log_dir = log_dir
        self._w = SummaryWriter(str(log_dir), purge_step=resume_step or None)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            if v is not None:
                self._w.add_scalar(k, float(v), global_step=step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


def open_tracker(kind: str, out: Path, resume_step: int = 0) -> Tracker:
    if kind == "tensorboard":
        return TensorBoardTracker(out / "tensorboard", resume_step)
    return Tracker()
