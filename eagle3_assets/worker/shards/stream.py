"""Hidden states streamed from a producer (the serving engine's connector, engines/vllm/connector.py in stream
mode) to their consumer (engines/vllm/streaming.py, for online training from an engine where no training GPU holds
the target): no shard file, a local socket. Beside the shards' writer: the same samples, not on disk.

A frame is one sample: MAGIC, then the lengths of its JSON header and its payload and the CRC-32 of both (one
struct, FRAME), then the header (`id`, anything the trainer needs, and each tensor's name, dtype, shape and byte
count), then the tensors' raw bytes back to back. A frame is taken only whole and with its checksum right: a
producer killed mid-frame, a short read or a flipped byte is a StreamError naming the sample, and nothing of it
is handed on, so a half-received sample is never trained on.

Bounded at both ends: `Receiver` reads on a thread of its own into a queue of `depth` frames; when the trainer
falls behind the queue fills, the thread stops reading, the socket's buffers fill, and the producer's `send`
blocks: the engine waits for the trainer, memory stays at `depth` samples plus the kernel's buffers."""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
import zlib
from pathlib import Path

import torch

from ..errors import StageError

MAGIC = b"E3HS"
FRAME = struct.Struct("<4sIQI")  # magic, header bytes, payload bytes, crc32(header + payload)
MAX_HEADER = 1 << 20  # a header past this is not ours: a stream out of step, not a sample
SOCKET_BUFFER = 1 << 20  # per direction: with the queue's depth, all that is in flight


class StreamError(StageError):
    """A frame that cannot be trained on; the message names the sample when its header got through."""


def _dtype(name: str) -> torch.dtype:
    got = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise StreamError(f"frame names dtype {name!r}, which this torch does not have")
    return got


def encode(header: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """One frame: `header` (JSON-able, with an `id`) and the tensors, by name."""
    blobs, specs = [], []
    for name, t in tensors.items():
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        specs.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "bytes": len(raw)})
        blobs.append(raw)
    head = json.dumps({**header, "tensors": specs}, separators=(",", ":")).encode()
    payload = b"".join(blobs)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return FRAME.pack(MAGIC, len(head), len(payload), crc) + head + payload


def decode(head: bytes, payload: bytes, crc: int) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    sample = header.get("id", "?") if isinstance(header, dict) else "?"
    if zlib.crc32(payload, zlib.crc32(head)) != crc or header is None:
        raise StreamError(f"sample {sample}: checksum mismatch ({len(payload)} bytes): the frame was damaged on "
                          "its way; it is dropped, nothing of it trained on")
    tensors, at = {}, 0
    for spec in header.pop("tensors", []):
        n = int(spec["bytes"])
        buf = bytearray(payload[at: at + n])
        t = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        tensors[spec["name"]] = t.view(_dtype(spec["dtype"])).reshape(spec["shape"])
        at += n
    if at != len(payload):
        raise StreamError(f"sample {sample}: the header accounts for {at} of the payload's {len(payload)} bytes")
    return header, tensors


def _read_exact(sock: socket.socket, n: int, what: str) -> bytes | None:
    """n bytes, None if the stream ended cleanly before the first; a StreamError if it ended within them."""
    view, got = bytearray(n), 0
    while got < n:
        k = sock.recv_into(memoryview(view)[got:], n - got)
        if k == 0:
            if got == 0 and what == "frame":
                return None
            raise StreamError(f"the producer's stream ended {got} bytes into a {n}-byte {what}: that sample is "
                              "dropped, nothing of it trained on (was the engine killed?)")
        got += k
    return bytes(view)


def read_frame(sock: socket.socket) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """The next whole frame from a blocking socket, None at a clean end of stream."""
    fixed = _read_exact(sock, FRAME.size, "frame")
    if fixed is None:
        return None
    magic, n_head, n_payload, crc = FRAME.unpack(fixed)
    if magic != MAGIC or n_head > MAX_HEADER:
        raise StreamError(f"the stream is out of step (frame starts {magic!r}, header {n_head} bytes): not a "
                          "hidden-state frame; the producer and the trainer run different versions?")
    head = _read_exact(sock, n_head, "frame header")
    payload = _read_exact(sock, n_payload, f"frame payload (after header {head[:120].decode(errors='replace')})")
    return decode(head, payload, crc)


class Sender:
    """The producer's end: connects to the trainer's socket; `send` blocks while the trainer is behind."""

    def __init__(self, path: str | Path, timeout_s: float = 60):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.sock.settimeout(None)  # from here blocking: backpressure, not an error

    def send(self, header: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.sock.sendall(encode(header, tensors))

    def close(self) -> None:
        self.sock.close()


_END = object()


class Receiver:
    """The trainer's end: listens on a Unix socket at `path`, takes one producer, and reads its frames on a thread
    into a queue of `depth`; iterate it for (header, tensors) in the order sent. A bad frame or a stream cut
    mid-frame is raised to the trainer when it reaches it, after every whole frame before it."""

    def __init__(self, path: str | Path, depth: int = 8, accept_timeout_s: float = 600):
        if depth < 1:
            raise ValueError("depth: at least one frame")
        self.path = Path(path)
        self.path.unlink(missing_ok=True)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(1)
        self.server.settimeout(accept_timeout_s)
        self.frames: queue.Queue = queue.Queue(maxsize=depth)
        self.received = 0
        self._ended = False
        self._conn: socket.socket | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hidden-state-stream", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self.frames.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError as e:
            self._put(StreamError(f"no producer connected to {self.path}: {e}") if not self._closed.is_set() else _END)
            return
        conn.settimeout(None)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self._conn = conn
        with conn:
            try:
                while (frame := read_frame(conn)) is not None:
                    if not self._put(frame):
                        return
                    self.received += 1
            except (StreamError, OSError) as e:
                self._put(e if isinstance(e, StreamError) else StreamError(f"the stream broke: {e}"))
                return
        self._put(_END)

    def next(self, timeout_s: float | None = None) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The next whole frame, None at the stream's clean end; TimeoutError when none came in `timeout_s` (the
        caller can look at its producer meanwhile)."""
        if self._ended:
            return None
        try:
            item = self.frames.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no frame on {self.path} in {timeout_s} s") from None
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def __iter__(self):
        while (item := self.next()) is not None:
            yield item

    def close(self) -> None:
        """Stops reading (a producer still sending sees the connection close) and removes the socket file."""
        self._closed.set()
        for sock in (self.server, self._conn):  # shutdown wakes a thread blocked in accept or recv; close does not
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.server.close()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
