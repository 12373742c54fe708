"""Stage `extract`: one hidden-state shard. The target runs forward (its decoder stack only: no lm_head)
with hooks on the 3 aux layers and the last layer; valid tokens are gathered on the device, copied once
into reusable (pinned, on GPU) part buffers, and written by a thread pool that hashes while it writes, so
the device keeps computing while parts go to disk."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common.shard_format import (
    FORMAT,
    FORMAT_V2,
    INDEX,
    LAYER_CONVENTION,
    MANIFEST,
    bytes_per_token,
    default_aux_layers,
    part_tokens,
    shard_name,
)
from ...common.sizes import size_text
from ..errors import StageError
from ..files import replace_dir, require_file, resolve
from ..shards.parts import check_aux_layers, check_storage
from ..shards.writer import Sample, ShardWriter
from ..target.size import check_fits
from . import ranks

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.extract import ExtractArgs


class HiddenStateCapture:
    """Forward hooks on decoder layers: `aux` = outputs of the aux layers, `final` = the last layer's
    output before the final norm (what the target's norm + lm_head turn into logits)."""

    def __init__(self, model, aux_layers: list[int]):
        from ..target.model import text_decoder

        self.base = text_decoder(model)  # a wrapper's (Kimi-K2.5's) text decoder, not its vision tower
        layers = self.base.layers
        n = len(layers)
        bad = [i for i in aux_layers if not 0 <= i < n]
        if len(aux_layers) != 3 or bad:
            raise StageError(f"aux_layers must be 3 decoder layer ids in [0, {n - 1}] for this {n}-layer target; "
                             f"got {aux_layers}")
        self.aux_layers, self.num_layers = list(aux_layers), n
        self._out: dict[int, object] = {}
        self._hooks = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(aux_layers) | {n - 1})]

    def _hook(self, i):
        def fn(_module, _inputs, output):
            self._out[i] = output[0] if isinstance(output, tuple) else output
        return fn

    def __call__(self, input_ids):
        """input_ids: right-padded [B, L]. No attention mask is passed on purpose: under causal attention a
        real token never sees the padding to its right, so its hidden states are those of the unpadded
        sample, and the maskless path runs the fused causal kernels (~10% faster than a padding mask on H200)."""
        import torch

        self._out.clear()
        self.base(input_ids=input_ids, use_cache=False)
        aux = torch.cat([self._out[i] for i in self.aux_layers], dim=-1)
        final = self._out[self.num_layers - 1]
        self._out.clear()
        return aux, final

    def last_aux(self):
        """The aux states of the latest forward through the hooked model (any caller, e.g. with a KV cache)."""
        import torch

        return torch.cat([self._out[i] for i in self.aux_layers], dim=-1)

    def close(self):
        for h in self._hooks:
            h.remove()


def make_batches(samples: list[Sample], batch_tokens: int, max_batch: int = 256) -> list[list[Sample]]:
    """Longest first, greedily packed so that batch size x longest length stays within batch_tokens."""
    order = sorted(samples, key=lambda s: -len(s.input_ids))
    batches, cur = [], []
    for s in order:
        if cur and ((len(cur) + 1) * len(cur[0].input_ids) > batch_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    return batches


def pad_batch(batch: list[Sample], multiple: int = 8):
    """Right-padded ids [B, L] (L rounded up for aligned kernels) and the flat indices of real tokens,
    samples in batch order."""
    import torch

    lengths = [len(s.input_ids) for s in batch]
    L = -(-lengths[0] // multiple) * multiple
    ids = torch.zeros((len(batch), L), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : lengths[b]] = torch.tensor(s.input_ids)
    valid = torch.cat([torch.arange(ln) + b * L for b, ln in enumerate(lengths)])
    return ids, valid, lengths


def extract_samples(model, samples: list[Sample], out_dir: Path, aux_layers: list[int], *, batch_tokens: int,
                    part_bytes: int, io_threads: int, progress=None, storage: str = "native",
                    prefix: str = "part-") -> ShardWriter:
    """Run the target over `samples` and write parts + rows into `out_dir`. Used by the stage and the bench."""
    import torch

    hidden = model.config.get_text_config().hidden_size
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    tokens = max(part_tokens(part_bytes, hidden, str(dtype).removeprefix("torch."), storage), batch_tokens)
    capture = HiddenStateCapture(model, aux_layers)
    writer = ShardWriter(out_dir, hidden, dtype, tokens, io_threads, pin=device.type == "cuda", storage=storage,
                         prefix=prefix)
    try:
        with torch.inference_mode():
            for batch in make_batches(samples, batch_tokens):
                ids, valid, lengths = pad_batch(batch)
                if device.type == "cuda":  # page-locked: the copies to the device never wait for it
                    ids, valid = ids.pin_memory(), valid.pin_memory()
                aux, final = capture(ids.to(device, non_blocking=True))
                # Gather the real tokens with an index built on the host: a boolean mask would make the host
                # wait for the device (nonzero), stalling the next batch's launch.
                valid = valid.to(device, non_blocking=True)
                writer.add(batch, lengths, aux.flatten(0, 1).index_select(0, valid),
                           final.flatten(0, 1).index_select(0, valid))
                if progress is not None:
                    progress.update(sum(lengths))
        writer.close()
    except BaseException:
        writer.pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        capture.close()
    return writer


def load_samples(conversations: Path, shard: int, samples_per_shard: int, max_length: int) -> tuple[list[Sample], int]:
    table = pq.read_table(conversations, columns=["id", "input_ids", "loss_mask"])
    start = shard * samples_per_shard
    if start >= table.num_rows:
        raise StageError(f"shard {shard} is past the end of the conversations ({table.num_rows} samples, "
                         f"{samples_per_shard} per shard): rematerialize conversations to refresh the shard list")
    part = table.slice(start, samples_per_shard).to_pylist()
    samples, truncated = [], 0
    for k, r in enumerate(part):
        ids, mask = r["input_ids"][:max_length], r["loss_mask"][:max_length]
        truncated += len(r["input_ids"]) > max_length
        if sum(mask):  # a sample with no assistant token teaches the drafter nothing
            samples.append(Sample(start + k, r["id"], ids, mask))
    return samples, truncated


def run(workdir: str, args: ExtractArgs, reporter) -> None:
    from .. import engines
    from ..target.model import load_config, load_model, pick_device, text_config

    backend = args.backend
    if backend != "hf" and backend not in engines.NAMES:  # hf, or an engine of worker/engines/
        raise StageError(f"backend must be one of {['hf', *engines.NAMES]}, got {backend!r}")
    shard = int(args.shard)
    conversations = require_file(resolve(workdir, args.conversations), "regenerated conversations",
                                 "materialize the conversations asset first")
    out_root = resolve(workdir, args.out_dir)
    target = resolve(workdir, args.target)
    cfg = text_config(load_config(target))
    num_layers = int(cfg.num_hidden_layers)
    aux_layers = list(args.aux_layers or default_aux_layers(num_layers))
    check_aux_layers(aux_layers, num_layers)
    from ..compute_dtype import choice, host_device, line

    dtype_info = choice(args.dtype, host_device(args.device))
    dtype = dtype_info["dtype"]
    storage = check_storage(args.storage)
    samples, truncated = load_samples(conversations, shard, int(args.samples_per_shard),
                                      int(args.max_length))
    name = shard_name(shard)
    processes = int(args.num_processes) if backend == "hf" else 1
    if ranks.is_rank():  # one of the processes a launch below started: its share, no publishing
        return ranks.rank_main(extract_samples, lambda device: load_model(target, dtype, device), samples, aux_layers,
                               args.model_copy(update={"storage": storage}), reporter, f"extract {name}")
    out_root.mkdir(parents=True, exist_ok=True)
    total = sum(len(s.input_ids) for s in samples)
    need = total * bytes_per_token(int(cfg.hidden_size), dtype, storage)
    free = shutil.disk_usage(out_root).free
    if need > free:
        raise StageError(f"{name} needs ~{size_text(need)} for {total:,} tokens of hidden states, but only "
                         f"{size_text(free)} are free under {out_root}: free space there or move the host's "
                         f"workdir to a bigger disk")
    if backend == "hf":
        device = pick_device(args.device)
        if processes > 1:
            ranks.check(processes, args.device)
        check_fits(target, dtype, device)  # before a GB is loaded
    reporter.log(line(dtype_info))
    for stale in out_root.glob(f".tmp-{name}-*"):  # left by a run that died: never complete, safe to drop
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if backend == "hf" and processes > 1:
            reporter.log(f"{name}: {len(samples)} samples, {total:,} tokens, aux layers {aux_layers} "
                         f"({LAYER_CONVENTION}) + final pre-norm, split over {processes} processes")
            files, index, devices, rank_wall = ranks.launch(
                workdir, args.model_copy(update={"dtype": dtype, "storage": storage}), reporter, processes, tmp)
            engine = {"engine": "transformers", "engine_version": _version("transformers"), "dtype": dtype}
            t0 = time.monotonic() - rank_wall  # tokens/s counts the slowest rank's work, not the model loads
        elif backend == "hf":
            model = load_model(target, dtype, device)
            devices = [str(next(model.parameters()).device)]
            reporter.log(f"{name}: {len(samples)} samples, {total:,} tokens, aux layers {aux_layers} "
                         f"({LAYER_CONVENTION}) + final pre-norm, on {next(model.parameters()).device}")
            t0 = time.monotonic()
            with reporter.progress(f"extract {name}", total, unit="tokens") as prog:
                writer = extract_samples(model, samples, tmp, aux_layers,
                                         batch_tokens=int(args.batch_tokens),
                                         part_bytes=int(args.part_bytes),
                                         io_threads=int(args.io_threads), progress=prog,
                                         storage=storage)
            files, index = writer.files, writer.index
            engine = {"engine": "transformers", "engine_version": _version("transformers"),
                      "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
        else:
            extract = engines.get(backend).extract
            reporter.log(f"{name}: {len(samples)} samples, {total:,} tokens, aux layers {aux_layers} "
                         f"({LAYER_CONVENTION}) + final pre-norm, through {backend}")
            files, index, engine = extract(target, samples, tmp, aux_layers, num_layers,
                                           args.model_copy(update={"dtype": dtype, "storage": storage}),
                                           reporter, f"extract {name}")
            engine["dtype"] = dtype
            t0 = time.monotonic() - engine["engine_wall_s"]  # tokens/s counts the engine's work, not its start
            devices = _engine_devices(engine)
        wall = time.monotonic() - t0
        final_dir = out_root / name
        manifest = publish_shard(tmp, final_dir, files, index, {
            "shard": shard, "target": str(target), "hidden_size": int(cfg.hidden_size), "num_layers": num_layers,
            "aux_layer_ids": aux_layers, "backend": backend, **engine, "storage": storage,
            "truncated_samples": int(truncated), "processes": processes, "devices": devices})
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    nbytes = manifest["bytes"]
    version = hashlib.sha256("".join(f["sha256"] for f in files).encode()).hexdigest()[:32]
    meta = {
        "path": str(final_dir),
        "shard": shard,
        "samples": manifest["samples"],
        "tokens": total,
        "loss_tokens": manifest["loss_tokens"],
        "bytes": nbytes,
        "bytes_per_token": round(nbytes / max(total, 1), 1),
        "tokens_per_s": round(total / max(wall, 1e-9), 1),
        "wall_s": round(wall, 2),
        "aux_layer_ids": aux_layers,
        "layer_convention": LAYER_CONVENTION,
        "backend": backend,
        "engine": engine["engine"],
        "engine_version": engine["engine_version"],
        **({"language_model_only": engine["language_model_only"]} if "language_model_only" in engine else {}),
        "parts": len(files),
        "processes": processes,  # hf: the ranks that split the shard; an engine: 1 (its own TP/DP below)
        "gpus": sum(d.startswith("cuda") for d in devices),
        "devices": devices,
        **{k: v for k, v in dtype_info.items() if k != "dtype"},
        "dtype": engine["dtype"],
        "storage": storage,
        "manifest": manifest,
    }
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({"path": str(final_dir), "tokens": total, "bytes": nbytes, "data_version": version})


def publish_shard(tmp: Path, final_dir: Path, files: list[dict], index: list[dict], fields: dict) -> dict:
    """Index and manifest (written last: a shard without one is never complete), then the atomic move."""
    from ..files import sha256_file

    index = sorted(index, key=lambda r: r["row"])
    pq.write_table(pa.Table.from_pylist(index), tmp / INDEX)
    manifest = {
        "format": FORMAT_V2 if fields.get("storage") == "fp8" else FORMAT,
        **fields,
        "layer_convention": LAYER_CONVENTION,
        "final": "last decoder layer output, before the final norm",
        "samples": len(index),
        "tokens": sum(r["length"] for r in index),
        "loss_tokens": sum(r["loss_tokens"] for r in index),
        "bytes": sum(f["bytes"] for f in files),
        "files": sorted(files, key=lambda f: f["name"]),
        "index": {"name": INDEX, "sha256": sha256_file(tmp / INDEX)},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    replace_dir(tmp, final_dir)
    return manifest


def _engine_devices(engine: dict) -> list[str]:
    """The GPUs an engine backend ran on: tensor x data parallel of them on a GPU host, none on a CPU host."""
    import torch

    n = int(engine.get("tensor_parallel_size", 1)) * int(engine.get("data_parallel_size", 1))
    return [f"cuda:{i}" for i in range(n)] if torch.cuda.is_available() else ["cpu"]


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
