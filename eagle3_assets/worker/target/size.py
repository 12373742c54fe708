"""How much memory a target's weights take once loaded, read from its safetensors headers alone (no
tensor is read), so that a stage can refuse a target its device cannot hold before loading a byte."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from ..errors import StageError

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# compressed-tensors pack-quantized checkpoints (Kimi-K2.5's INT4 experts): int32 words of 8 int4 values,
# which transformers decompresses to the model dtype at load
_PACKED_PER_WORD = 8


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def weight_bytes(target: Path, dtype: str) -> int:
    """Bytes of the target's weights in `dtype` as transformers would hold them."""
    total = 0
    for f in sorted(target.glob("*.safetensors")):
        for name, t in _header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            if name.endswith("weight_packed"):
                n *= _PACKED_PER_WORD
            elif name.endswith(("weight_shape", "weight_scale", "weight_zero_point")):
                continue  # quantization bookkeeping, gone after decompression
            total += n * _BYTES.get(dtype, 2)
    return total


def check_fits(target: Path, dtype: str, device: str) -> None:
    """The hf backend holds the whole target on one device: refuse one that cannot fit there (quantized
    experts count at their unpacked size: transformers decompresses them), naming the way that works."""
    import torch

    need = weight_bytes(target, dtype)
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        have, where = torch.cuda.get_device_properties(idx).total_memory, f"GPU {idx} ({torch.cuda.get_device_name(idx)})"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's memory"
    if need > 0.9 * have:
        raise StageError(f"the hf backend would load the whole target ({need / 1e9:,.1f} GB of weights in {dtype}) on one "
                         f"device, but {where} has {have / 1e9:,.1f} GB: set hidden_state_shards' backend to vllm, "
                         f"which serves the target with tensor parallelism over the host's GPUs "
                         f"(tensor_parallel_size), or use a smaller target")


