"""The stream online training from an engine reads hidden states through (worker/shards/stream.py), over a
real Unix socket from a producer in a process of its own: samples arrive whole and in order, a producer ahead of
the trainer waits, and a producer killed mid-frame or a damaged frame never hands on half a sample."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3_assets.worker.shards.stream import Receiver, StreamError, encode

ROOT = Path(__file__).resolve().parents[2]
# The producer: N samples of the given size; after each whole send, the count in `progress`. `cut`: after the
# first 3, half of the next frame, then a file `cut` says so and it sleeps until killed. `damage`: the 3rd
# frame's last payload byte flipped.
PRODUCER = r"""
import sys, time, torch
from pathlib import Path
from eagle3_assets.worker.shards.stream import Sender, encode
path, n, tokens, progress, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
s = Sender(path)
for i in range(n):
    g = torch.Generator().manual_seed(i)
    tensors = {"aux": torch.randn(tokens, 12, generator=g).to(torch.bfloat16), "final": torch.randn(tokens, 4, generator=g),
               "input_ids": torch.arange(tokens) + i}
    frame = encode({"id": f"s{i}", "row": i}, tensors)
    if mode == "cut" and i == 3:
        s.sock.sendall(frame[: len(frame) // 2])
        Path(str(progress) + ".cut").write_text("cut")
        time.sleep(600)
    if mode == "damage" and i == 2:
        s.sock.sendall(frame[:-1] + bytes([frame[-1] ^ 0xFF]))
    else:
        s.send({"id": f"s{i}", "row": i}, tensors)
    progress.write_text(str(i + 1))
s.close()
"""


def _expected(i: int, tokens: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"aux": torch.randn(tokens, 12, generator=g).to(torch.bfloat16), "final": torch.randn(tokens, 4, generator=g),
            "input_ids": torch.arange(tokens) + i}


def _producer(tmp: Path, sock: Path, n: int, tokens: int, mode: str = "plain") -> tuple[subprocess.Popen, Path]:
    progress = tmp / "progress"
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, str(sock), str(n), str(tokens), str(progress), mode],
                            cwd=ROOT, start_new_session=True)
    return proc, progress


def _sent(progress: Path) -> int:
    try:
        return int(progress.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.fixture
def sock(tmp_path) -> Path:
    return Path(f"/tmp/e3hs-{os.getpid()}-{tmp_path.name[-12:]}.sock")  # AF_UNIX paths: 107 bytes at most


def test_samples_arrive_whole_and_in_order_and_the_stream_ends_cleanly(tmp_path, sock):
    with Receiver(sock, depth=4) as rx:
        proc, _ = _producer(tmp_path, sock, 5, 37)
        got = list(rx)
    assert proc.wait(60) == 0
    assert [h["id"] for h, _ in got] == [f"s{i}" for i in range(5)] and [h["row"] for h, _ in got] == list(range(5))
    for i, (_, tensors) in enumerate(got):
        want = _expected(i, 37)
        assert set(tensors) == set(want)
        for name, t in want.items():
            assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    assert not sock.exists()


def test_a_producer_ahead_of_the_trainer_waits_for_it(tmp_path, sock):
    """40 samples of ~1 MiB each (aux bf16 + final + ids at 32k tokens), the trainer taking none for a while: the
    producer is held at what the queue and the socket's buffers hold, then sends the rest as the trainer takes."""
    n, tokens = 40, 32768
    with Receiver(sock, depth=2) as rx:
        proc, progress = _producer(tmp_path, sock, n, tokens)
        deadline = time.monotonic() + 60
        while _sent(progress) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # the trainer is busy: nothing taken
        held = _sent(progress)
        assert 2 <= held < n // 2, f"the producer sent {held} of {n} samples while the trainer took none"
        assert proc.poll() is None
        got = [h["id"] for h, _ in rx]
    assert proc.wait(60) == 0 and got == [f"s{i}" for i in range(n)]


def test_a_producer_killed_mid_frame_hands_on_only_whole_samples(tmp_path, sock):
    with Receiver(sock, depth=8) as rx:
        proc, progress = _producer(tmp_path, sock, 6, 50, "cut")
        try:
            cut = Path(str(progress) + ".cut")
            deadline = time.monotonic() + 60
            while not cut.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cut.exists(), "the producer never reached its cut"
            os.killpg(proc.pid, signal.SIGKILL)  # our own producer, by its process group
            proc.wait(30)
            got = []
            with pytest.raises(StreamError, match="ended .* bytes into a .*-byte frame payload") as err:
                for header, tensors in rx:
                    got.append(header["id"])
                    assert torch.equal(tensors["final"], _expected(header["row"], 50)["final"])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert got == ["s0", "s1", "s2"]
    assert "nothing of it trained on" in str(err.value) and '"id":"s3"' in str(err.value)


def test_a_damaged_frame_is_refused_naming_its_sample(tmp_path, sock):
    with Receiver(sock, depth=8) as rx:
        proc, _ = _producer(tmp_path, sock, 5, 20, "damage")
        got = []
        with pytest.raises(StreamError, match="sample s2: checksum mismatch"):
            for header, _ in rx:
                got.append(header["id"])
    proc.wait(60)
    assert got == ["s0", "s1"]


def test_a_stream_out_of_step_is_refused_not_read_as_a_sample(tmp_path, sock):
    import socket

    with Receiver(sock, depth=2) as rx:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(sock))
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        with pytest.raises(StreamError, match="out of step"):
            list(rx)
        s.close()
    frame = encode({"id": "x"}, {"t": torch.zeros(0)})  # an empty tensor travels too
    assert frame[:4] == b"E3HS"
