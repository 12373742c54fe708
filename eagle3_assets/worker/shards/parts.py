"""The tensors of a hidden-state shard (the format itself: common/shard_format.py): fp8 quantization with
per-token scales, part files written in the safetensors layout, and the checks a stage makes before writing.

Parts are written by `write_part` (streamed from pinned buffers with the sha256 computed on the way, so no
extra copy of hundreds of MB per part) and read with the safetensors library.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ...common.shard_format import FP8_MAX, LAYER_CONVENTION, STORAGES
from ..errors import StageError


def check_storage(storage: str) -> str:
    if storage not in STORAGES:
        raise StageError(f"storage must be one of {list(STORAGES)} (native: the compute dtype, fp8: float8 e4m3 "
                         f"with per-token scales, half of bf16 on disk), got {storage!r}")
    return storage


def quantize_fp8(x, layers: int):
    """[T, layers*H] -> (float8_e4m3fn [T, layers*H], float32 scales [T, layers]), one scale per token and
    layer: the layers differ in size by orders of magnitude, so one shared scale would flush the small ones."""
    t = x.unflatten(-1, (layers, -1))
    # the max of |x| is exact in x's own dtype; the division promotes to float32 as it reads (one pass fewer
    # over a float32 copy of the states: the same values as converting first)
    scale = t.abs().amax(-1, keepdim=True).float().clamp_min(1e-30) / FP8_MAX
    q = torch.div(t, scale).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


def dequantize_fp8(q, scale):
    """The inverse of quantize_fp8, in float32."""
    layers = scale.shape[-1]
    return (q.float().unflatten(-1, (layers, -1)) * scale.float().unsqueeze(-1)).flatten(-2)


_ST_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32",
              "torch.int64": "I64", "torch.int32": "I32", "torch.uint8": "U8", "torch.float8_e4m3fn": "F8_E4M3"}


def write_part(path: Path, tensors: dict, chunk: int = 64 << 20) -> tuple[int, str]:
    """Write contiguous CPU tensors as a safetensors file; return (bytes, sha256)."""
    header, offset, views = {}, 0, []
    for name, t in tensors.items():
        assert t.is_contiguous(), name
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        views.append(memoryview(t.view(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b""))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the spec aligns the data start to 8 bytes
    prefix = struct.pack("<Q", len(head)) + head
    h = hashlib.sha256(prefix)
    with open(path, "wb") as f:
        f.write(prefix)
        for v in views:
            for s in range(0, len(v), chunk):
                block = v[s: s + chunk]
                h.update(block)
                f.write(block)
        # on disk before the manifest can name it: a crash then never leaves a "complete" shard with a part
        # that was only in the page cache (the writer threads sync while the producer computes on)
        f.flush()
        os.fsync(f.fileno())
    return len(prefix) + offset, h.hexdigest()


def check_aux_layers(aux: list[int], num_layers: int) -> None:
    """3 distinct decoder layer ids of the target, in our convention."""
    bad = [i for i in aux if not 0 <= int(i) < num_layers]
    if len(aux) != 3 or bad or len(set(aux)) != 3:
        raise StageError(f"aux_layers must be 3 distinct decoder layer ids in [0, {num_layers - 1}] for this "
                         f"{num_layers}-layer target ({LAYER_CONVENTION}: id i is the output of layer i); got {list(aux)}"
                         + (f" ({bad} outside the target)" if bad else ""))
