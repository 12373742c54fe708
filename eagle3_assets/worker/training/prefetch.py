"""Training batches made ahead of the step that uses them.

On a GPU a thread assembles each batch (shard reads, packing) into page-locked memory and copies it to the
device on a stream of its own, `depth` batches ahead, so the step neither waits for the host nor for the
copy. `finish` runs on each batch once it is on the device (on that stream: dequantizing fp8 states there
overlaps the step too). Elsewhere (the CPU path) a batch is made when it is asked for, exactly as before: no
thread competes with training for the cores.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """`items`: [(key, arg)] in step order; `make(arg)` -> dict of CPU tensors (pinned on a GPU) and plain
    values, which pass through. Iterating yields (key, finish(batch on `device`))."""

    def __init__(self, items, make, device: str, depth: int = 3, finish=lambda batch: batch):
        self.device = torch.device(device)
        self.make, self.finish = make, finish
        self.cuda = self.device.type == "cuda"
        self._items = iter(items)
        self.made, self.make_s, self.wait_s = 0, 0.0, 0.0  # batches made, host time making them, time waited
        if self.cuda:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._stream = torch.cuda.Stream(self.device)
            self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
            self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if not self.cuda:
            key, arg = next(self._items)
            return key, self.finish({k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                                     for k, v in self.make(arg).items()})
        t = time.perf_counter()
        got = self._q.get()
        self.wait_s += time.perf_counter() - t
        if got is _END:
            raise StopIteration
        if isinstance(got, _Failed):
            raise got.error
        key, batch, copied = got
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)  # on the GPU, not the host
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                v.record_stream(stream)  # its memory is not reused before this stream is done with it
        return key, batch

    def _fill(self) -> None:
        try:
            with torch.cuda.device(self.device):
                for key, arg in self._items:
                    if self._stop.is_set():
                        return
                    t = time.perf_counter()
                    host = self.make(arg)
                    self.made, self.make_s = self.made + 1, self.make_s + time.perf_counter() - t
                    with torch.cuda.stream(self._stream):
                        batch = self.finish({k: v.to(self.device, non_blocking=True)
                                             if isinstance(v, torch.Tensor) else v for k, v in host.items()})
                        copied = torch.cuda.Event()
                        copied.record(self._stream)
                    self._put((key, batch, copied))
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            self._put(_Failed(e))

    def _put(self, x) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(x, timeout=0.1)
                return
            except queue.Full:
                continue

    def summary(self) -> str:
        if not self.cuda or not self.made:
            return ""
        return (f"batches: {self.made} made ahead by a thread, {1e3 * self.make_s / self.made:.0f} ms each on the "
                f"host; the step loop waited {self.wait_s:.1f} s for them in all")

    def close(self) -> None:
        if not self.cuda:
            return
        self._stop.set()
        while True:  # unblock a put, then let the thread see the stop
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=60)
