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

This module is the format's names and sizes (standard library only: the control plane sizes disks with it);
the tensors' side (fp8 quantization, writing parts, the checks a stage makes) is worker/hidden_states/parts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from .sizes import size_text

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


HIDDEN_STATES = ("offline", "online", "auto")  # train's `hidden_states`: from shards on disk, or from the target as it trains
DISK_MARGIN = 0.2  # auto: offline only when the shards fit the free disk with this much to spare
DEFAULT_STORAGE = "fp8"  # what the extraction writes unless told otherwise (stages/extract.py's default reads it)


def shards_bytes(tokens: int, hidden_size: int, storage: str = "fp8", dtype: str = "bfloat16") -> int:
    """What offline shards of `tokens` tokens would take on disk: tokens x (3 aux + 1 final) x hidden x the bytes
    per value of the storage (bf16 2; fp8, format v2, 1 + its per-token scales), plus ids and loss mask."""
    return int(tokens) * bytes_per_token(hidden_size, dtype, storage)


def choose_hidden_states(mode: str, need_bytes: int, free_bytes: int, have_shards: bool,
                         margin: float = DISK_MARGIN) -> tuple[str, str]:
    """(offline | online, why). `auto`: offline when shards are given (on disk already) or would fit the free disk
    with `margin` to spare, online when they would not; an explicit mode is kept."""
    room = f"{size_text(need_bytes)} of shards against {size_text(free_bytes)} free"
    if mode != "auto":
        return mode, f"hidden_states {mode} (set)"
    if have_shards:
        return "offline", "auto: the shards are on disk already"
    if need_bytes * (1 + margin) > free_bytes:
        return "online", f"auto: {room}, which is less than they need with a {margin:.0%} margin"
    return "offline", f"auto: {room}, they fit with a {margin:.0%} margin"


def part_tokens(part_bytes: int, hidden_size: int, dtype: str, storage: str = "native") -> int:
    """Tokens per part file of about `part_bytes` (at least 1)."""
    return max(int(part_bytes) // bytes_per_token(hidden_size, dtype, storage), 1)


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


MIN_TARGET_LAYERS = 3  # an EAGLE-3 drafter reads three distinct layers of its target


def engine_default_aux_layers(num_layers: int) -> list[int]:
    """The layers vLLM and SGLang capture when a drafter's config names none: their capture-before defaults
    (2, N//2, N-3) in output-of-layer terms, SpecForge's too. Not three distinct layers below 7 layers."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def default_aux_layers(num_layers: int) -> list[int]:
    """Our default: the engines' own (a drafter trained on them needs no layer ids in its exported config),
    or, for a target of 3-6 layers where those are not distinct, its first, middle and last layers (then
    written into the export)."""
    ids = engine_default_aux_layers(num_layers)
    if num_layers >= 7:
        return ids
    return [0, num_layers // 2, num_layers - 1]


def read_manifest(shard_dir: Path) -> dict | None:
    """The manifest of a complete shard, or None if the shard is absent or incomplete."""
    try:
        return json.loads((shard_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
