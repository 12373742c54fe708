"""Hidden states from vLLM without shard files: the target served as for extraction (extraction.py beside it), our
connector in stream mode sending each finished sample's states to a Unix socket (connector.py, shards/stream.py),
this module its client and consumer. `EngineStream.states(samples)` yields (sample, aux, final) in the order given,
whatever order the engine finishes them in: the way online training from an engine reads its batches.

Bounded: at most `window` samples are asked for and not yet handed on (in the engine, in the socket, or received
out of order and held), and the receiver's queue holds `depth` frames; when the consumer is behind, the engine's
sends block and its next step waits. Each frame is checked against its sample (its token ids, as many rows as
tokens, its loss spans) before it is handed on; a request that failed, an engine that died, or a sample the engine
never sent is a StageError naming the sample. One data-parallel engine (the socket takes one producer); tensor
parallel as configured (rank 0 sends)."""

from __future__ import annotations

import http.client
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ... import engines
from ...errors import StageError
from ...shards.stream import Receiver
from ...shards.writer import Sample
from ..dump import engine_run, loss_spans
from ..server import EngineServer, free_port
from .extraction import post_completion, sample_request

if TYPE_CHECKING:
    from ....stages.extract import ExtractSettings

POLL_S = 2.0  # how often a consumer waiting on a frame looks at the engine and the requests


class EngineStream:
    """The target served by vLLM for the aux layers, streaming; a context manager (the server and the socket)."""

    def __init__(self, target: Path, aux_layers: list[int], num_layers: int, args: ExtractSettings, reporter,
                 max_len: int, log: Path, window: int = 16, depth: int = 4):
        if int(args.data_parallel_size) != 1:
            raise StageError(f"streaming from vLLM takes one data-parallel engine, not {args.data_parallel_size}: "
                             "set data_parallel_size 1 (tensor_parallel_size spreads the target), or extract shards")
        if window < 1 or depth < 1:
            raise StageError(f"window ({window}) and depth ({depth}): at least one sample each")
        self.target, self.args, self.reporter, self.window = target, args, reporter, int(window)
        self.vllm = engines.get("vllm")
        self.run = engine_run(self.vllm, target, aux_layers, num_layers, args)
        self._dir = tempfile.mkdtemp(prefix="e3s-")  # a socket path must stay short (108 bytes)
        self.socket = Path(self._dir) / "states.sock"
        self.receiver = Receiver(self.socket, depth=depth, accept_timeout_s=float(args.ready_timeout_s) + 600)
        self.port = free_port()
        argv = self.vllm.extract_command(
            self.run.python, str(target), self.port, layer_ids=self.run.capture_ids, root=self._dir,
            aux_columns=self.run.aux_columns, final_column=self.run.final_column, part_bytes=int(args.part_bytes),
            io_threads=int(args.io_threads), dtype=args.dtype, storage=args.storage,
            max_model_len=int(args.max_model_len or max_len), tensor_parallel_size=self.run.tp, data_parallel_size=1,
            seed=int(args.seed), extra=list(args.extra_args or []), stream=str(self.socket))
        if self.vllm.text_only(target, self.run.info, args.language_model_only) and "--language-model-only" not in argv:
            argv.append("--language-model-only")
        self.server = EngineServer("vllm (streaming hidden states)", argv, self.port, log,
                                   env={**self.vllm.EXTRACT_ENV, **self.run.env}, health=self.vllm.HEALTH)
        self.sent = self.received = 0
        self.ready_s: float | None = None
        self._probe = [1, 2, 3, 4, 5, 6, 7, 8]  # the end request's prompt: a few tokens of the last pass

    def __enter__(self) -> EngineStream:
        try:
            self.server.__enter__()
            self.ready_s = self.server.wait_ready(float(self.args.ready_timeout_s), self.reporter)
        except BaseException:
            self.close()
            raise
        self.reporter.log(f"vllm {self.run.info['version']} streams hidden states (capture ids {self.run.capture_ids}, "
                          f"TP={self.run.tp}) to {self.socket}, after {self.ready_s:.0f} s")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.server.__exit__(None, None, None)
        finally:
            self.receiver.close()
            shutil.rmtree(self._dir, ignore_errors=True)

    def states(self, samples: list[Sample]) -> Iterator[tuple[Sample, torch.Tensor, torch.Tensor]]:
        """Each sample's (sample, aux [n, layers*H], final [n, H]) in the engine's dtype, in the order given."""
        rows = [s.row for s in samples]
        wanted = set(rows)
        if len(wanted) != len(rows):
            raise StageError("the samples to stream repeat a row: each sample needs its own row to be told apart")
        self._probe = list(samples[0].input_ids[:8]) if samples else self._probe
        slots = threading.Semaphore(self.window)
        failed: list[BaseException] = []
        stop = threading.Event()

        def one(s: Sample) -> None:
            try:
                post_completion(self.port, sample_request(s, "stream"))
            except (OSError, http.client.HTTPException, ValueError, StageError) as e:
                failed.append(StageError(f"streaming request for row {s.row} ({s.id}) failed: {e}"))

        def feed() -> None:  # in order, at most `window` not yet handed on
            with ThreadPoolExecutor(max_workers=int(self.args.concurrency)) as pool:
                for s in samples:
                    while not slots.acquire(timeout=0.5):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    pool.submit(one, s)
                    self.sent += 1

        feeder = threading.Thread(target=feed, name="stream-feeder", daemon=True)
        feeder.start()
        held: dict[int, tuple[dict, dict]] = {}
        try:
            for s in samples:
                while s.row not in held:
                    header, tensors = self._frame(s, failed)
                    if "flush" in header:
                        raise StageError(f"the engine ended the stream before row {s.row} ({s.id})")
                    if int(header.get("row", -1)) not in wanted:
                        raise StageError(f"vllm streamed row {header.get('row')} ({header.get('id')}), which was not "
                                         "asked for in this pass: another client on this engine?")
                    held[int(header["row"])] = (header, tensors)
                header, tensors = held.pop(s.row)
                slots.release()
                yield s, *self._checked(s, header, tensors)
        finally:
            stop.set()
            feeder.join(timeout=30)

    def end(self) -> None:
        """Ask the engine for its end frame and wait for it: every frame sent before it has been received."""
        nonce = uuid.uuid4().hex
        # a few tokens, not one: a one-token prompt runs the decode path, which some backends lack (CPU MLA)
        post_completion(self.port, {"model": "target", "prompt": self._probe, "max_tokens": 1,
                          "kv_transfer_params": {"eagle3": {"dir": "stream", "flush": nonce}}})
        while True:
            header, _ = self._frame(None, [])
            if header.get("flush") == nonce:
                return
            raise StageError(f"frame {header.get('id')} arrived after every sample asked for was handed on")

    def _frame(self, s: Sample | None, failed: list) -> tuple[dict, dict]:
        waited = 0.0
        while True:
            if failed:
                raise failed[0]
            try:
                got = self.receiver.next(POLL_S)
            except TimeoutError:
                waited += POLL_S
                why = self.server.died(wait_s=1)
                if why:
                    raise StageError(f"vllm died while streaming{f' row {s.row} ({s.id})' if s else ''}:\n{why}") from None
                if waited >= float(self.args.flush_timeout_s):
                    raise StageError(f"no hidden states from vllm in {waited:.0f} s"
                                     + (f", waiting for row {s.row} ({s.id})" if s else "")
                                     + f": see {self.server.log_path}") from None
                continue
            if got is None:
                raise StageError("the engine closed the stream" + (f" before row {s.row} ({s.id})" if s else ""))
            self.received += 1
            return got

    @staticmethod
    def _checked(s: Sample, header: dict, tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
        aux, final = tensors.get("aux"), tensors.get("final")
        n = len(s.input_ids)
        problems = []
        if header.get("input_ids") != list(s.input_ids):
            problems.append("its token ids differ from the conversation's")
        if aux is None or final is None or aux.shape[0] != n or final.shape[0] != n:
            problems.append(f"{None if aux is None else aux.shape[0]} hidden-state rows for {n} tokens "
                            "(a short dump: prefix caching or chunked prefill on?)")
        if header.get("loss_spans") != loss_spans(s.loss_mask):
            problems.append("its loss spans differ from ours")
        if problems:
            raise StageError(f"row {s.row} ({s.id}) streamed from vllm: " + "; ".join(problems))
        return aux, final

