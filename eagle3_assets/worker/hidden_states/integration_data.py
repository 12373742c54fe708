"""Stage `integration_data`: the integration gate's data. The first `samples` conversations (with loss) of
the first shard, copied as they were extracted into a shard of their own (the gate's drafter memorises them)
with their prompts (the engine is then served exactly those); and, when the shards came from an engine
backend, the parity of their hidden states against the transformers forward on a few of them (parity.py)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common.shard_format import INDEX, read_manifest
from ..errors import StageError
from ..files import atomic_file, require_file, resolve
from ..shards.parts import dequantize_fp8, write_part
from .extract import publish_shard

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.integration_data import IntegrationDataArgs

_KEEP = ("shard", "target", "hidden_size", "num_layers", "aux_layer_ids", "backend", "engine", "engine_version",
         "dtype", "storage")


def _read(shard: Path, rows: list[dict]) -> list[dict]:
    """Each index row's tensors, as stored (fp8 stays fp8, with its scales)."""
    from safetensors import safe_open

    out, handles = [], {}
    try:
        for r in rows:
            if r["part"] not in handles:
                handles[r["part"]] = safe_open(str(shard / r["part"]), framework="pt")
            f = handles[r["part"]]
            lo, hi = r["offset"], r["offset"] + r["length"]
            out.append({k: f.get_slice(k)[lo:hi] for k in f.keys()})
    finally:
        handles.clear()
    return out


def _float(t: dict, key: str):
    return dequantize_fp8(t[key], t[f"{key}_scale"]) if f"{key}_scale" in t else t[key].float()


def run(workdir: str, args: IntegrationDataArgs, reporter) -> None:
    import torch

    src = resolve(workdir, args.shards[0])
    manifest = read_manifest(src)
    if manifest is None:
        raise StageError(f"hidden-state shard {src} is missing or incomplete (no manifest): rerun that "
                         "hidden_state_shards partition")
    rows = [r for r in pq.read_table(src / INDEX).to_pylist() if r["loss_tokens"] > 0][: int(args.samples)]
    if len(rows) < int(args.samples):
        reporter.log(f"{src} holds {len(rows)} samples with loss, fewer than the {args.samples} asked for: using "
                     "those", "warning")
    if not rows:
        raise StageError(f"{src} holds no sample with loss tokens: the gate has nothing to memorise")
    tensors = _read(src, rows)
    out = resolve(workdir, args.out)
    out.mkdir(parents=True, exist_ok=True)

    # the shard: one part of the chosen samples, as extracted
    tmp = out / f".tmp-shard-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        joined = {k: torch.cat([t[k] for t in tensors]).contiguous() for k in tensors[0]}
        nbytes, digest = write_part(tmp / "part-0000.safetensors", joined)
        files = [{"name": "part-0000.safetensors", "bytes": nbytes, "sha256": digest,
                  "tokens": int(joined["input_ids"].shape[0])}]
        index, offset = [], 0
        for r in rows:
            index.append({**r, "part": "part-0000.safetensors", "offset": offset})
            offset += r["length"]
        publish_shard(tmp, out / "shard", files, index, {k: manifest[k] for k in _KEEP if k in manifest})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    # their prompts, in the prompts' layout (id, messages): what serve_bench and speculate read
    conv = require_file(resolve(workdir, args.conversations), "regenerated conversations",
                        "materialize the conversations asset first")
    ids = [r["id"] for r in rows]
    by_id = {c["id"]: c for c in pq.read_table(conv, columns=["id", "messages"]).to_pylist() if c["id"] in set(ids)}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise StageError(f"samples {missing[:3]} of {src} are not in {conv}: the shards were extracted from other "
                         "conversations; rematerialize hidden_state_shards")
    with atomic_file(out / "prompts.parquet") as t:
        pq.write_table(pa.Table.from_pylist([by_id[i] for i in ids]), t)

    found = None
    if manifest.get("backend", "hf") != "hf" and int(args.parity_samples) > 0:
        found = _parity(workdir, args, manifest, tensors[: int(args.parity_samples)], reporter)
    tokens = sum(r["length"] for r in rows)
    meta = {"shard": str(out / "shard"), "prompts": str(out / "prompts.parquet"), "samples": len(rows),
            "tokens": tokens, "reply_tokens": min(r["loss_tokens"] for r in rows), "source_shard": str(src),
            "backend": manifest.get("backend", "hf"), "parity": found}
    reporter.materialize(metadata=meta)
    reporter.result(meta)


def _parity(workdir: str, args: IntegrationDataArgs, manifest: dict, tensors: list[dict], reporter) -> dict:
    from ..compute_dtype import choice, host_device
    from ..target.model import load_config, load_model, text_config
    from ..target.moe_routing import routing
    from .parity import parity

    target = resolve(workdir, args.target)
    dtype = args.dtype or choice(manifest.get("dtype") or "auto", host_device(args.device))["dtype"]
    model = load_model(target, dtype, args.device)
    samples = [{"input_ids": t["input_ids"], "aux": _float(t, "aux"), "final": _float(t, "final")} for t in tensors]
    found = parity(model, list(manifest["aux_layer_ids"]), samples, routing(text_config(load_config(target))) is not None)
    for name, v in found["layers"].items():
        reporter.log(f"parity {manifest['backend']} vs transformers, {name}: norm ratio {v['norm_ratio']:.4f}, "
                     f"cosine {v['cosine']:.4f}{'' if v['passed'] else '  (outside the tolerance)'}")
    return found
