"""The hidden-state shard format (the contract between extraction and training).

A shard is a directory `shard-NNNNN/` holding
- `part-NNNN.safetensors`: many samples concatenated on the token axis: `input_ids` [T] int64,
  `loss_mask` [T] uint8, `aux` [T, 3H] (outputs of the 3 aux layers, concatenated low|mid|high),
  `final` [T, H] (the last decoder layer's output, before the final norm);
- `index.parquet`: one row per sample: row, id, part, offset, length, loss_tokens;
- `manifest.json`, written last: sizes, token counts and sha256 of every file, the aux layer ids and their
  convention. A shard directory without a manifest is never complete.

Format v2 (`storage: fp8`) stores `aux` and `final` as float8 e4m3 with one float32 scale per token and layer
(`aux_scale` [T, 3], `final_scale` [T, 1]: x = q * scale, scale = max|x| / 448 over the layer's H values):
4·H + 25 bytes per token, half of bf16. Readers take both versions; `dequantize` gives float32 back.

Parts are written by `write_part` (the safetensors layout, streamed from pinned buffers with the sha256
computed on the way, so no extra copy of hundreds of MB per part) and read with the safetensors library.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

FORMAT = "eagle3-hidden-states/v1"
FORMAT_V2 = "eagle3-hidden-states/v2"
STORAGES = ("native", "fp8")  # native: the compute dtype, as extracted (v1); fp8: e4m3 + per-token scales (v2)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
LAYER_CONVENTION = "output_of_layer"  # aux id i = output of decoder layer i = HF hidden_states[i + 1]
MANIFEST = "manifest.json"
INDEX = "index.parquet"

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", storage: str = "native") -> int:
    """Disk per token: aux [3H] + final [H] in `dtype` (or fp8 + 4 float32 scales), input_ids int64,
    loss_mask uint8."""
    if storage == "fp8":
        return 4 * hidden_size + 4 * 4 + 9
    return 4 * hidden_size * DTYPE_BYTES[dtype] + 9


def part_tokens(part_bytes: int, hidden_size: int, dtype: str, storage: str = "native") -> int:
    """Tokens per part file of about `part_bytes` (at least 1)."""
    return max(int(part_bytes) // bytes_per_token(hidden_size, dtype, storage), 1)


def check_storage(storage: str) -> str:
    if storage not in STORAGES:
        from .errors import StageError

        raise StageError(f"storage must be one of {list(STORAGES)} (native: the compute dtype, fp8: float8 e4m3 "
                         f"with per-token scales, half of bf16 on disk), got {storage!r}")
    return storage


def quantize_fp8(x, layers: int):
    """[T, layers*H] -> (float8_e4m3fn [T, layers*H], float32 scales [T, layers]), one scale per token and
    layer: the layers differ in size by orders of magnitude, so one shared scale would flush the small ones."""
    import torch

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


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's defaults in output-of-layer terms; equal to vLLM's and SGLang's capture-before defaults
    (2, N//2, N-3), so a drafter trained on them needs no layer ids in its exported config."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def write_part(path: Path, tensors: dict, chunk: int = 64 << 20) -> tuple[int, str]:
    """Write contiguous CPU tensors as a safetensors file; return (bytes, sha256)."""
    header, offset, views = {}, 0, []
    for name, t in tensors.items():
        assert t.is_contiguous(), name
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        views.append(memoryview(t.view(-1).view(__import__("torch").uint8).numpy()) if nbytes else memoryview(b""))
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


def read_manifest(shard_dir: Path) -> dict | None:
    """The manifest of a complete shard, or None if the shard is absent or incomplete."""
    try:
        return json.loads((shard_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def check_aux_layers(aux: list[int], num_layers: int) -> None:
    """3 distinct decoder layer ids of the target, in our convention."""
    bad = [i for i in aux if not 0 <= int(i) < num_layers]
    if len(aux) != 3 or bad or len(set(aux)) != 3:
        from .errors import StageError

        raise StageError(f"aux_layers must be 3 distinct decoder layer ids in [0, {num_layers - 1}] for this "
                         f"{num_layers}-layer target ({LAYER_CONVENTION}: id i is the output of layer i); got {list(aux)}"
                         + (f" ({bad} outside the target)" if bad else ""))
