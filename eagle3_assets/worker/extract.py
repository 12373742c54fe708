"""Stage `extract`: one hidden-state shard. The target runs forward (its decoder stack only: no lm_head)
with hooks on the 3 aux layers and the last layer; valid tokens are gathered on the device, copied once
into reusable (pinned, on GPU) part buffers, and written by a thread pool that hashes while it writes, so
the device keeps computing while parts go to disk."""

from __future__ import annotations

import json
import queue
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import StageError
from .files import replace_dir, require_file, resolve
from .shard_format import (FORMAT, INDEX, LAYER_CONVENTION, MANIFEST, bytes_per_token, default_aux_layers, shard_name,
                           write_part)


@dataclass
class Sample:
    row: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


class HiddenStateCapture:
    """Forward hooks on decoder layers: `aux` = outputs of the aux layers, `final` = the last layer's
    output before the final norm (what the target's norm + lm_head turn into logits)."""

    def __init__(self, model, aux_layers: list[int]):
        self.base = model.get_decoder()
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


class _Part:
    def __init__(self, cap_tokens: int, hidden: int, dtype, pin: bool):
        import torch

        self.aux = torch.empty((cap_tokens, 3 * hidden), dtype=dtype, pin_memory=pin)
        self.final = torch.empty((cap_tokens, hidden), dtype=dtype, pin_memory=pin)
        self.ids = torch.empty((cap_tokens,), dtype=torch.int64)
        self.mask = torch.empty((cap_tokens,), dtype=torch.uint8)
        self.cap = cap_tokens
        self.reset()

    def reset(self):
        self.used, self.rows, self.event = 0, [], None


class ShardWriter:
    """Fills part buffers batch by batch; full parts go to a thread pool that writes and hashes them."""

    def __init__(self, out_dir: Path, hidden: int, dtype, part_tokens: int, io_threads: int, pin: bool):
        self.out_dir, self.hidden = out_dir, hidden
        self.pool = ThreadPoolExecutor(max_workers=io_threads)
        self.free: queue.Queue[_Part] = queue.Queue()
        for _ in range(io_threads + 1):  # one being filled while io_threads are written
            self.free.put(_Part(part_tokens, hidden, dtype, pin))
        self.cur = self.free.get()
        self.futures: list[Future] = []
        self.files: list[dict] = []
        self.index: list[dict] = []
        self.part_no = 0

    def add(self, batch: list[Sample], lengths: list[int], aux, final) -> None:
        """aux/final: valid tokens of the batch on the device, samples in `batch` order."""
        import torch

        n = aux.shape[0]
        if self.cur.used + n > self.cur.cap:
            self.flush()
        p, o = self.cur, self.cur.used
        p.aux[o: o + n].copy_(aux, non_blocking=True)
        p.final[o: o + n].copy_(final, non_blocking=True)
        off = o
        for s, ln in zip(batch, lengths):
            p.ids[off: off + ln] = torch.tensor(s.input_ids[:ln], dtype=torch.int64)
            p.mask[off: off + ln] = torch.tensor(s.loss_mask[:ln], dtype=torch.uint8)
            p.rows.append({"row": s.row, "id": s.id, "offset": off, "length": ln,
                           "loss_tokens": int(sum(s.loss_mask[:ln]))})
            off += ln
        p.used = off
        if aux.is_cuda:
            p.event = torch.cuda.Event()
            p.event.record()

    def flush(self) -> None:
        p = self.cur
        if p.used == 0:
            return
        name = f"part-{self.part_no:04d}.safetensors"
        self.part_no += 1
        for r in p.rows:
            r["part"] = name
        self.index.extend(p.rows)
        self.futures.append(self.pool.submit(self._write, p, name))
        self.cur = self.free.get()  # blocks while all buffers are being written: back-pressure

    def _write(self, p: _Part, name: str) -> dict:
        try:
            if p.event is not None:
                p.event.synchronize()
            t = p.used
            tensors = {"input_ids": p.ids[:t], "loss_mask": p.mask[:t], "aux": p.aux[:t], "final": p.final[:t]}
            nbytes, digest = write_part(self.out_dir / name, tensors)
            return {"name": name, "bytes": nbytes, "sha256": digest, "tokens": t}
        finally:
            p.reset()
            self.free.put(p)

    def close(self) -> None:
        self.flush()
        self.files = [f.result() for f in self.futures]  # re-raises a failed write
        self.pool.shutdown()


def extract_samples(model, samples: list[Sample], out_dir: Path, aux_layers: list[int], *, batch_tokens: int,
                    part_bytes: int, io_threads: int, progress=None) -> ShardWriter:
    """Run the target over `samples` and write parts + rows into `out_dir`. Used by the stage and the bench."""
    import torch

    hidden = model.config.get_text_config().hidden_size
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    bytes_per_token = 4 * hidden * dtype.itemsize
    part_tokens = max(part_bytes // bytes_per_token, batch_tokens)
    capture = HiddenStateCapture(model, aux_layers)
    writer = ShardWriter(out_dir, hidden, dtype, part_tokens, io_threads, pin=device.type == "cuda")
    try:
        with torch.inference_mode():
            for batch in make_batches(samples, batch_tokens):
                ids, valid, lengths = pad_batch(batch)
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


def run(workdir: str, args: dict, reporter) -> None:
    from .target import load_config, load_model, text_config

    shard = int(args["shard"])
    conversations = require_file(resolve(workdir, args["conversations"]), "regenerated conversations",
                                 "materialize the conversations asset first")
    out_root = resolve(workdir, args.get("out_dir", "hidden_states"))
    target = resolve(workdir, args["target"])
    cfg = text_config(load_config(target))
    aux_layers = list(args.get("aux_layers") or default_aux_layers(cfg.num_hidden_layers))
    samples, truncated = load_samples(conversations, shard, int(args["samples_per_shard"]),
                                      int(args.get("max_length", 2048)))
    name = shard_name(shard)
    out_root.mkdir(parents=True, exist_ok=True)
    for stale in out_root.glob(f".tmp-{name}-*"):  # left by a run that died: never complete, safe to drop
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()

    total = sum(len(s.input_ids) for s in samples)
    need = total * bytes_per_token(int(cfg.hidden_size), args.get("dtype", "bfloat16"))
    free = shutil.disk_usage(out_root).free
    if need > free:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StageError(f"{name} needs ~{need / 1e9:,.3f} GB for {total:,} tokens of hidden states, but only "
                         f"{free / 1e9:,.3f} GB are free under {out_root}: free space there or move the host's "
                         f"workdir to a bigger disk")
    model = load_model(target, args.get("dtype", "bfloat16"), args.get("device", "auto"))
    reporter.log(f"{name}: {len(samples)} samples, {total:,} tokens, aux layers {aux_layers} "
                 f"({LAYER_CONVENTION}) + final pre-norm, on {next(model.parameters()).device}")
    t0 = time.monotonic()
    try:
        with reporter.progress(f"extract {name}", total, unit="tokens") as prog:
            writer = extract_samples(model, samples, tmp, aux_layers,
                                     batch_tokens=int(args.get("batch_tokens", 16384)),
                                     part_bytes=int(args.get("part_bytes", 1 << 30)),
                                     io_threads=int(args.get("io_threads", 4)), progress=prog)
        wall = time.monotonic() - t0
        pq.write_table(pa.Table.from_pylist(writer.index), tmp / INDEX)
        from .files import sha256_file

        nbytes = sum(f["bytes"] for f in writer.files)
        manifest = {
            "format": FORMAT,
            "shard": shard,
            "target": str(target),
            "hidden_size": int(cfg.hidden_size),
            "num_layers": int(cfg.num_hidden_layers),
            "aux_layer_ids": aux_layers,
            "layer_convention": LAYER_CONVENTION,
            "final": "last decoder layer output, before the final norm",
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "samples": len(writer.index),
            "tokens": total,
            "loss_tokens": sum(r["loss_tokens"] for r in writer.index),
            "truncated_samples": int(truncated),
            "bytes": nbytes,
            "files": writer.files,
            "index": {"name": INDEX, "sha256": sha256_file(tmp / INDEX)},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        final_dir = out_root / name
        replace_dir(tmp, final_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    import hashlib

    version = hashlib.sha256("".join(f["sha256"] for f in writer.files).encode()).hexdigest()[:32]
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
        "parts": len(writer.files),
        "manifest": manifest,
    }
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({"path": str(final_dir), "tokens": total, "bytes": nbytes, "data_version": version})
