"""Pipes messages through a temporary file on this machine, with nothing lost at the end.

Dagster's file reader tails the file and stops at the first empty read after the session closes; a worker's last
lines (its error, its result) written between that read and the close are dropped, and the step then fails with a
bare exit status. Here the stop is seen *before* a read, so the read that ends the loop comes after every write."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from dagster_pipes import PipesDefaultMessageWriter


def tail_lines(path: str, stopped: threading.Event, poll_s: float = 0.01) -> Iterator[str]:
    """Whole lines appended to `path` until `stopped` is set and the file holds nothing more."""
    pending = ""
    with open(path, encoding="utf-8") as f:
        while True:
            last_pass = stopped.is_set()  # set only after the writer is done: this pass reads everything left
            chunk = f.readline()
            while chunk:
                pending += chunk
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                chunk = f.readline()
            if last_pass:
                if pending.strip():  # a last line without its newline (the writer died mid-line): still a line
                    yield pending
                return
            time.sleep(poll_s)


class TempFileMessages(dg.PipesMessageReader):
    """Reads the messages of one worker (rank 0 relays data-parallel ranks) from a file in a temporary folder."""

    @contextmanager
    def read_messages(self, handler) -> Iterator[dict]:
        with tempfile.TemporaryDirectory(prefix="eagle3-pipes-") as tmp:
            path = os.path.join(tmp, "messages")
            open(path, "w").close()
            stopped = threading.Event()
            reader = threading.Thread(target=self._read, args=(path, stopped, handler), daemon=True)
            reader.start()
            try:
                yield {PipesDefaultMessageWriter.FILE_PATH_KEY: path,
                       PipesDefaultMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: False}
            finally:
                stopped.set()
                reader.join()

    @staticmethod
    def _read(path: str, stopped: threading.Event, handler) -> None:
        try:
            for line in tail_lines(path, stopped):
                handler.handle_message(json.loads(line))
        except Exception:
            handler.report_pipes_framework_exception("eagle3 message reader thread", sys.exc_info())

    @property
    def expected_writer_count(self) -> int:
        return 1

    def no_messages_debug_text(self) -> str:
        return "Attempted to read messages from a local temporary file."
