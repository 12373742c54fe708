"""How a stage reports to whoever started it: Dagster Pipes when present, else the terminal.

Stages call `log`, `progress`, `materialize` and `result`; they never see dagster_pipes directly, so the
same stage runs by hand on a host (`python -m eagle3_assets.worker ...`) with plain terminal output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

from ..common.worker_env import NO_BAR_ENV
from ..stages import check_reported


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Reporter:
    def __init__(self, pipes=None):
        self._pipes = pipes
        self.result_payload: dict | None = None
        self.stage: str | None = None  # set: metadata and result are checked against the stage's contract
        # training curves for TensorBoard & co (training/tracker.py: `scalars`, `close`); none by default
        self.tracker = None
        # under a data-parallel launch: rank 0 speaks JSON lines for the launcher to relay, others are quiet
        self._relay = os.environ.get("EAGLE3_REPORT_JSONL") == "1"
        self._quiet = self._relay and os.environ.get("RANK", "0") != "0"

    def _emit(self, every_rank: bool = False, **msg) -> bool:
        if self._quiet and not every_rank:
            return True
        if self._relay:
            print(json.dumps(msg, default=str), flush=True)
            return True
        return False

    def log(self, msg: str, level: str = "info", every_rank: bool = False) -> None:
        """`every_rank`: said by any rank of a launch, not only rank 0 (a rank's own failure)."""
        if self._emit(every_rank, kind="log", message=msg, level=level):
            return
        if self._pipes is not None:
            getattr(self._pipes.log, level)(msg)
        else:
            print(f"[{level}] {msg}", file=sys.stderr, flush=True)

    @contextmanager
    def progress(self, what: str, total: int, unit: str = "tokens", every_s: float = 5.0) -> Iterator[Progress]:
        p = Progress(self, what, total, unit, every_s)
        try:
            yield p
        finally:
            p.close()

    def scalars(self, step: int, **values: float) -> None:
        """Figures along a run (loss, accuracy, lr) for the experiment tracker; Dagster gets the metadata."""
        if self.tracker is not None and not self._quiet:
            self.tracker.scalars(step, values)

    def materialize(self, metadata: dict[str, Any], data_version: str | None = None) -> None:
        if self.stage:
            check_reported(self.stage, "metadata", metadata)
        if self._emit(kind="materialize", metadata=metadata, data_version=data_version):
            return
        if self._pipes is not None:
            self._pipes.report_asset_materialization(metadata=_typed(metadata), data_version=data_version)
        else:
            print(json.dumps({"metadata": metadata, "data_version": data_version}, default=str), file=sys.stderr)

    def result(self, payload: dict) -> None:
        """The stage's small JSON answer to the control plane."""
        if self.stage:
            check_reported(self.stage, "result", payload)
        self.result_payload = payload
        if self._emit(kind="result", payload=payload):
            return
        if self._pipes is not None:
            self._pipes.report_custom_message({"kind": "result", "payload": payload})

    def error(self, message: str) -> None:
        if self._emit(kind="error", message=message):
            return
        if self._pipes is not None:
            self._pipes.report_custom_message({"kind": "error", "message": message})
        self.log(message, "error")


def _typed(metadata: dict[str, Any]) -> dict[str, Any]:
    """Pipes infers scalars; structured values and paths are declared so the UI renders them as such."""
    out = {}
    for k, v in metadata.items():
        if v is None:
            continue
        if k.endswith("_chart") and isinstance(v, str):
            out[k] = {"raw_value": v, "type": "md"}
        elif isinstance(v, (dict, list)):
            out[k] = {"raw_value": v, "type": "json"}
        elif k == "path" and isinstance(v, str):
            out[k] = {"raw_value": v, "type": "path"}
        else:
            out[k] = v
    return out


class Progress:
    """Counts work done; logs `done/total, rate, ETA` to Pipes every few seconds and draws a terminal bar."""

    def __init__(self, reporter: Reporter, what: str, total: int, unit: str, every_s: float):
        self.reporter, self.what, self.total, self.unit, self.every_s = reporter, what, total, unit, every_s
        self.done = 0
        self.tokens = 0  # when the unit is not tokens (turns, samples), tokens still get a rate
        self.start = self._last = time.monotonic()
        # The bar goes to stderr: a terminal shows it; under Dagster it lands in the step's compute log.
        self._bar = tqdm(total=total, unit=unit[:-1] if unit.endswith("s") else unit, unit_scale=True,
                         desc=what, file=sys.stderr, disable=os.environ.get(NO_BAR_ENV) == "1" or reporter._quiet,
                         mininterval=1.0)

    def update(self, n: int, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        self._bar.update(n)
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self.reporter.log(self.line())

    def set_total(self, total: int) -> None:
        """The work was replanned (a time budget cut it short): the bar and the ETA follow the new plan."""
        self.total = self._bar.total = total
        self._bar.refresh()

    @property
    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.start, 1e-9)

    def line(self) -> str:
        rate = self.rate
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta_s = _fmt_eta(eta) if eta != float("inf") else "?"
        line = f"{self.what}: {self.done:,}/{self.total:,} {self.unit} ({pct:.1f}%), {rate:,.1f} {self.unit}/s"
        if self.tokens:
            tok_rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
            line += f", {self.tokens:,} tokens, {tok_rate:,.0f} tokens/s"
        return line + f", ETA {eta_s}"

    def close(self) -> None:
        self._bar.close()
        self.reporter.log(self.line() + f", {time.monotonic() - self.start:.1f} s")


def relayed(stream) -> Iterator[dict]:
    """The messages of a worker run with EAGLE3_REPORT_JSONL=1, read from its stdout; any other line is
    passed on to stderr as it is."""
    for line in stream:
        try:
            msg = json.loads(line)
        except ValueError:
            print(line, end="", file=sys.stderr)
            continue
        if isinstance(msg, dict):
            yield msg
