"""What an engine hands back for a shard (vLLM's connector, SGLang's capture): part files written by our
ShardWriter inside the engine, and one `engine-parts-d<dp>.json` per data-parallel engine listing them
with their index rows; and how the stage checks the dump before anything is published. Standard library
only on the engine side (the engine's environment need not have pyarrow)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StageError
from ..shards.writer import Sample

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.extract import ExtractArgs

PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding eagle3_assets/


@dataclass
class EngineRun:
    """What both engine backends settle before starting the engine."""
    python: str
    info: dict  # the engine's answer to its extraction probe
    capture_ids: list[int]  # in the engine's numbering
    aux_columns: list[int]
    final_column: int
    tp: int
    dp: int
    env: dict


def engine_run(engine, target: Path, aux_layers: list[int], num_layers: int, args: ExtractArgs) -> EngineRun:
    """Ask the engine (a StageError naming what is missing), translate the layer ids, and the environment
    that lets its processes import our code, wherever the worker code was uploaded."""
    from .server import check_support

    python = args.engine_python or sys.executable
    env = {str(k): str(v) for k, v in (args.env or {}).items()}
    check_parallel(target, int(args.tensor_parallel_size), int(args.data_parallel_size), visible_gpus(env),
                   engine.TITLE)
    info = check_support(engine, python, target, probe=engine.EXTRACT_PROBE, purpose="extract hidden states")
    ids, cols, final = engine.capture_layers(aux_layers, num_layers)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return EngineRun(python, info, ids, cols, final, int(args.tensor_parallel_size),
                     int(args.data_parallel_size), env)


def visible_gpus(env: dict) -> int:
    """The GPUs the engine will see: CUDA_VISIBLE_DEVICES from its environment (the stage's `env`, else the
    worker's), else every GPU torch finds on the host."""
    listed = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip() and d.strip() != "-1"])
    import torch

    return torch.cuda.device_count()


def check_parallel(target: Path, tp: int, dp: int, gpus: int, title: str) -> None:
    """Refuse, before an engine spends minutes starting, what it would refuse after: more GPUs than the host
    has (TP x DP; a host without GPUs is not checked: the engine's CPU build places its ranks itself), and a
    TP that does not divide the target's attention heads, or its KV heads (the engines shard both by TP)."""
    cfg = json.loads((target / "config.json").read_text())
    tc = cfg.get("text_config") or cfg  # a wrapper's (Kimi's) text model
    problems = []
    if gpus and tp * dp > gpus:
        problems.append(f"tensor_parallel_size {tp} x data_parallel_size {dp} = {tp * dp} GPUs, and this host "
                        f"has {gpus}")
    heads = tc.get("num_attention_heads")
    if heads and heads % tp:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and (not gpus or d * dp <= gpus)]
        problems.append(f"tensor_parallel_size {tp} does not divide the target's {heads} attention heads "
                        f"({title} would load the target, then refuse it: it splits the heads evenly over TP "
                        f"ranks); sizes that fit: {fits}")
    kv = tc.get("num_key_value_heads")
    if kv and not tc.get("kv_lora_rank") and (kv % tp if tp <= kv else tp % kv):  # MLA keeps one latent KV
        problems.append(f"tensor_parallel_size {tp} and the target's {kv} KV heads: one must divide the other")
    if problems:
        raise StageError(f"{title} cannot extract with these settings: " + "; ".join(problems)
                         + ". Set tensor_parallel_size (and data_parallel_size) to fit the target and the host")


def parts_file(dp_rank: int) -> str:
    return f"engine-parts-d{dp_rank}.json"


def mask_from_spans(length: int, spans: list[list[int]]) -> list[int]:
    mask = [0] * length
    for a, b in spans:
        mask[a:b] = [1] * (max(0, min(b, length) - a))
    return mask


def loss_spans(mask: list[int]) -> list[list[int]]:
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


def write_parts(path: Path, nonce: str, dp_rank: int, writer, problems: list[str]) -> None:
    """Close `writer` (None: nothing was written) and publish its parts list atomically; a failed write is
    reported in the file, for the stage to fail the shard with."""
    out = {"nonce": nonce, "dp_rank": dp_rank, "files": [], "index": [], "problems": list(problems)}
    if writer is not None:
        try:
            writer.close()
            out.update(files=writer.files, index=writer.index)
        except Exception as ex:  # a full disk...: the stage fails the shard with this
            out["error"] = f"{type(ex).__name__}: {ex}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)


def collect(tmp: Path, ranks: int, nonce: str, died, timeout_s: float, engine: str) -> tuple[list, list, list]:
    """Wait for every engine's parts file with this nonce; (files, index rows, problems) of all of them.
    `died()`: why the engine is gone, or None."""
    results = []
    deadline = time.monotonic() + timeout_s
    for rank in range(ranks):
        path = tmp / parts_file(rank)
        while True:
            try:
                got = json.loads(path.read_text())
                if got.get("nonce") == nonce:
                    break
            except (OSError, ValueError):
                pass
            if (why := died()) is not None:
                raise StageError(f"{engine} died before finishing the shard's parts: {why}")
            if time.monotonic() > deadline:
                raise StageError(f"{engine} engine {rank} did not finish the shard's parts within {timeout_s:g} s")
            time.sleep(0.2)
        if got.get("error"):
            raise StageError(f"{engine} engine {rank} failed writing the shard's parts: {got['error']}")
        results.append(got)
        path.unlink()
    return ([f for r in results for f in r["files"]], [row for r in results for row in r["index"]],
            [p for r in results for p in r["problems"]])


def stored_ids(tmp: Path):
    """`read_ids(row)` for validate_dump: the token ids a part file holds for an index row."""
    from safetensors import safe_open

    handles = {}

    def read_ids(row: dict) -> list[int]:
        h = handles.get(row["part"]) or handles.setdefault(row["part"], safe_open(str(tmp / row["part"]), "pt"))
        return h.get_slice("input_ids")[row["offset"]: row["offset"] + row["length"]].tolist()

    return read_ids


def validate_dump(samples: list[Sample], index: list[dict], read_ids, problems: list[str]) -> None:
    """Every sample exactly once, with as many rows as tokens and the ids asked for; a StageError naming
    the first bad samples and the likely cause otherwise. `read_ids(row)`: the ids stored for an index row."""
    by_row: dict[int, list[dict]] = {}
    for r in index:
        by_row.setdefault(int(r["row"]), []).append(r)
    bad = list(problems)
    for s in samples:
        got = by_row.get(s.row, [])
        if len(got) != 1:
            bad.append(f"row {s.row} ({s.id}): written {len(got)} times")
            continue
        r = got[0]
        if r["length"] != len(s.input_ids):
            bad.append(f"row {s.row} ({s.id}): {r['length']} hidden-state rows for {len(s.input_ids)} tokens")
        elif read_ids(r) != s.input_ids:
            bad.append(f"row {s.row} ({s.id}): the engine's token ids differ from the tokenized conversation")
        elif r["loss_tokens"] != sum(s.loss_mask):
            bad.append(f"row {s.row} ({s.id}): {r['loss_tokens']} loss tokens, expected {sum(s.loss_mask)}")
    extra = sorted(set(by_row) - {s.row for s in samples})
    if extra:
        bad.append(f"rows {extra[:5]} were written but not asked for")
    if bad:
        short = any("hidden-state rows for" in b for b in bad)
        cause = (" A dump shorter than its tokens comes from prefix caching or chunked prefill in some engine "
                 "releases (vLLM; SGLang's radix cache): keep both off for extraction, or upgrade the engine."
                 if short else "")
        raise StageError(f"the engine's dump fails validation for {len(bad)} sample(s): " + "; ".join(bad[:5])
                         + (" ..." if len(bad) > 5 else "") + "." + cause + " Nothing was published.")
