"""Part files of a hidden-state shard, written while the producer keeps computing: samples' states are
copied once into reusable part buffers (pinned when the producer is a GPU), full parts go to a thread pool
that writes and hashes them. Used in-process by the hf extractor and inside the vLLM engine by our KV
connector, so it imports neither pyarrow nor anything of the engine."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .parts import check_storage, quantize_fp8, write_part


@dataclass
class Sample:
    row: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


class _Part:
    def __init__(self, cap_tokens: int, hidden: int, dtype, pin: bool, reused: bool = True, fp8: bool = False):
        import torch

        if fp8:
            dtype = torch.float8_e4m3fn
        self.aux = torch.empty((cap_tokens, 3 * hidden), dtype=dtype, pin_memory=pin)
        self.final = torch.empty((cap_tokens, hidden), dtype=dtype, pin_memory=pin)
        self.scales = ((torch.empty((cap_tokens, 3), dtype=torch.float32, pin_memory=pin),
                        torch.empty((cap_tokens, 1), dtype=torch.float32, pin_memory=pin)) if fp8 else None)
        self.ids = torch.empty((cap_tokens,), dtype=torch.int64)
        self.mask = torch.empty((cap_tokens,), dtype=torch.uint8)
        self.cap, self.reused = cap_tokens, reused
        self.reset()

    def reset(self):
        self.used, self.rows, self.event = 0, [], None


class ShardWriter:
    """Fills part buffers batch by batch; full parts go to a thread pool that writes and hashes them."""

    def __init__(self, out_dir: Path, hidden: int, dtype, part_tokens: int, io_threads: int, pin: bool,
                 prefix: str = "part-", storage: str = "native"):
        self.out_dir, self.hidden, self.dtype, self.prefix = out_dir, hidden, dtype, prefix
        self.fp8 = check_storage(storage) == "fp8"
        self.pool = ThreadPoolExecutor(max_workers=io_threads)
        self.free: queue.Queue[_Part] = queue.Queue()
        for _ in range(io_threads + 1):  # one being filled while io_threads are written
            self.free.put(_Part(part_tokens, hidden, dtype, pin, fp8=self.fp8))
        self.cur = self.free.get()
        self.futures: list[Future] = []
        self.files: list[dict] = []
        self.index: list[dict] = []
        self.part_no = 0
        self.io_threads = io_threads
        self._lock = threading.Lock()
        self.stream = None  # on a GPU: the stream the device-to-host copies run on, beside the compute

    def add(self, batch: list[Sample], lengths: list[int], aux, final) -> None:
        """aux/final: valid tokens of the batch on the device, samples in `batch` order."""
        import torch

        n = aux.shape[0]
        if self.cur.used + n > self.cur.cap:
            self.flush()
        if n > self.cur.cap:  # longer than a part buffer (one long sample): a part of its own, sized to fit
            regular, self.cur = self.cur, _Part(n, self.hidden, self.dtype, pin=False, reused=False, fp8=self.fp8)
            self.add(batch, lengths, aux, final)
            self._submit()
            self.cur = regular
            return
        p, o = self.cur, self.cur.used
        if self.fp8:  # quantized where the states are (on a GPU: before the copy, which then moves half)
            (aux, aux_scale), (final, final_scale) = quantize_fp8(aux, 3), quantize_fp8(final, 1)
            pairs = [(p.scales[0], aux_scale), (p.scales[1], final_scale), (p.aux, aux), (p.final, final)]
        else:
            pairs = [(p.aux, aux), (p.final, final)]
        if aux.is_cuda:  # copied on a stream of its own, so the next batch's forward runs meanwhile
            if self.stream is None:
                self.stream = torch.cuda.Stream(aux.device)
            self.stream.wait_stream(torch.cuda.current_stream(aux.device))
            with torch.cuda.stream(self.stream):
                for dst, src in pairs:
                    dst[o: o + n].copy_(src, non_blocking=True)
                    src.record_stream(self.stream)  # not reused by the next forward before the copy is done
                p.event = torch.cuda.Event()
                p.event.record(self.stream)
        else:
            for dst, src in pairs:
                dst[o: o + n].copy_(src)
        off = o
        for s, ln in zip(batch, lengths):
            p.ids[off: off + ln] = torch.tensor(s.input_ids[:ln], dtype=torch.int64)
            p.mask[off: off + ln] = torch.tensor(s.loss_mask[:ln], dtype=torch.uint8)
            p.rows.append({"row": s.row, "id": s.id, "offset": off, "length": ln,
                           "loss_tokens": int(sum(s.loss_mask[:ln]))})
            off += ln
        p.used = off

    def flush(self) -> None:
        if self.cur.used == 0:
            return
        self._submit()
        self.cur = self.free.get()  # blocks while all buffers are being written: back-pressure

    def _submit(self, pieces: int = 1) -> None:
        """The current part to the writers; `pieces` > 1 splits it at sample boundaries into that many part
        files of about equal size, written side by side (the last part, which nothing else overlaps)."""
        p = self.cur
        cuts, rows = [0], p.rows
        if pieces > 1 and len(rows) > 1:
            per = p.used / min(pieces, len(rows))
            for k, r in enumerate(rows[1:], 1):
                if r["offset"] >= per * len(cuts) and len(cuts) < pieces:
                    cuts.append(k)
        cuts.append(len(rows))
        left = [len(cuts) - 1]
        for a, b in zip(cuts, cuts[1:]):
            name = f"{self.prefix}{self.part_no:04d}.safetensors"
            self.part_no += 1
            lo = rows[a]["offset"]
            hi = rows[b - 1]["offset"] + rows[b - 1]["length"]
            for r in rows[a:b]:
                r["part"] = name
                r["offset"] -= lo
            self.index.extend(rows[a:b])
            self.futures.append(self.pool.submit(self._write, p, name, lo, hi, left))

    def _write(self, p: _Part, name: str, lo: int, hi: int, left: list) -> dict:
        try:
            if p.event is not None:
                p.event.synchronize()
            tensors = {"input_ids": p.ids[lo:hi], "loss_mask": p.mask[lo:hi], "aux": p.aux[lo:hi],
                       "final": p.final[lo:hi]}
            if p.scales is not None:
                tensors.update(aux_scale=p.scales[0][lo:hi], final_scale=p.scales[1][lo:hi])
            nbytes, digest = write_part(self.out_dir / name, tensors)
            return {"name": name, "bytes": nbytes, "sha256": digest, "tokens": hi - lo}
        finally:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if p.reused and last:
                p.reset()
                self.free.put(p)

    def close(self) -> None:
        if self.cur.used:  # the last part is what the producer waits for: split among the writer threads
            self._submit(pieces=self.io_threads)
        self.files = [f.result() for f in self.futures]  # re-raises a failed write
        self.pool.shutdown()
