"""Training batches from hidden-state shards, read through memory maps (the data can be far larger than
RAM), packed into rows of whole samples, in an order fixed by (seed, epoch) so that a resumed run sees
exactly the batches an uninterrupted one would.

Before a single sample is used, every part and index file is checked against the sha256 its manifest
records, and the hidden states for NaN/inf: once per run, up front. Training reads every token every epoch
anyway, so one more pass costs at most 1/epochs of its I/O, and a damaged shard then fails in seconds,
naming the file, instead of hours into a run (or never, as an all-NaN drafter).

fp8 shards (format v2) travel as they are stored: a GPU batch holds the fp8 bytes and their per-token scales
and is dequantized on the device (`on_device`), a quarter of the host work and of the copy that float32 would
be; the checks read the bytes too (an e4m3 value is NaN or it is finite)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch

from ...common.shard_format import FORMAT, FORMAT_V2, INDEX, read_manifest
from ..errors import StageError
from ..files import sha256_file
from ..shards.parts import dequantize_fp8


@dataclass(frozen=True)
class Ref:
    part: Path
    offset: int
    length: int


def _rerun(d: Path) -> str:
    return f"rerun hidden_state_shards partition {d.name.removeprefix('shard-')}"


class ShardSet:
    """`verify`: check every file's sha256 against its manifest and the hidden states for NaN/inf (see the
    module's docstring); `identity`, per shard, is what the training fingerprint compares."""

    def __init__(self, shard_dirs: list[Path], hidden_size: int, aux_layer_ids: list[int] | None = None,
                 verify: bool = True, mix_dirs: list[Path] = (), mix_share: float = 0.0, seed: int = 0):
        """`mix_dirs`: more shards (the data a finetuned drafter was trained on), of which a seeded sample joins the
        samples of `shard_dirs` so that it makes `mix_share` of the whole (or all of them, when too few)."""
        self.refs: list[Ref] = []
        self.mix = {"new_samples": 0, "old_samples": 0, "old_available": 0, "old_share": 0.0}
        mix_dirs = [d for d in mix_dirs if d not in shard_dirs]
        shard_dirs = list(shard_dirs) + mix_dirs
        old_refs: list[Ref] = []
        self.aux_layer_ids = None
        self.identity: list[dict] = []
        self.verified_bytes = 0
        self.all_fp8 = True  # every part in format v2 (a batch can then travel as stored: collate)
        self._handles: dict[Path, object] = {}
        parts: list[tuple[Path, dict, Path]] = []
        for d in shard_dirs:
            m = read_manifest(d)
            if m is None:
                raise StageError(f"hidden-state shard {d} is missing or incomplete (no manifest): rerun that "
                                 "hidden_state_shards partition")
            if m.get("format") not in (FORMAT, FORMAT_V2):
                raise StageError(f"{d / 'manifest.json'} says format {m.get('format')!r}; this version reads "
                                 f"{FORMAT!r} and {FORMAT_V2!r}: the shard was written by another version of "
                                 f"eagle3-assets (update it here too) or by another tool; {_rerun(d)}")
            if m["hidden_size"] != hidden_size:
                raise StageError(f"hidden states in {d} are {m['hidden_size']}-wide (field hidden_size of its "
                                 f"manifest) but the target's hidden size is {hidden_size}: they were extracted from "
                                 "another model; rematerialize hidden_state_shards with this target")
            if self.aux_layer_ids is None:
                self.aux_layer_ids = list(m["aux_layer_ids"])
            elif list(m["aux_layer_ids"]) != self.aux_layer_ids:
                raise StageError(f"shard {d} was extracted with aux layers {m['aux_layer_ids']}, others with "
                                 f"{self.aux_layer_ids}: rematerialize all shards with the same aux_layers")
            if not (m.get("index") or {}).get("sha256") or any(not f.get("sha256") for f in m["files"]):
                raise StageError(f"{d / 'manifest.json'} records no sha256 for some of its files (written by an "
                                 f"older version), so they cannot be checked: {_rerun(d)}")
            for f in m["files"]:
                p = d / f["name"]
                if not p.exists() or p.stat().st_size != f["bytes"]:
                    raise StageError(f"{p} is missing or not the size its manifest records ({f['bytes']} bytes): "
                                     f"{_rerun(d)}")
                self._check_part(p, f["tokens"], hidden_size)
                parts.append((p, f, d))
            index = d / INDEX
            if verify and sha256_file(index) != m["index"]["sha256"]:
                raise StageError(f"{index}: its sha256 differs from the one {d / 'manifest.json'} records: the "
                                 f"index was rewritten or damaged after extraction, so its samples cannot be trusted; "
                                 f"{_rerun(d)}")
            into = old_refs if d in mix_dirs else self.refs
            for r in pq.read_table(index).to_pylist():
                into.append(Ref(d / r["part"], r["offset"], r["length"]))
            # content identity: the manifest's hashes (checked against the files when verify is on)
            self.identity.append({"aux_layer_ids": list(m["aux_layer_ids"]), "index": m["index"]["sha256"],
                                  "files": [[f["name"], f["sha256"]] for f in m["files"]]})
        if aux_layer_ids is not None and self.aux_layer_ids is not None and list(aux_layer_ids) != self.aux_layer_ids:
            raise StageError(f"the drafter reads aux layers {list(aux_layer_ids)} but the hidden states hold layers "
                             f"{self.aux_layer_ids}: rematerialize hidden_state_shards with aux_layers "
                             f"{list(aux_layer_ids)} (output-of-layer convention)")
        if not self.refs:
            raise StageError("the hidden-state shards hold no samples")
        if old_refs:
            self._mix_in(old_refs, mix_share, seed)
        if verify:
            # hashlib and torch release the GIL: parts are checked in parallel, the first bad one (in order) raises
            with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
                list(pool.map(lambda pfd: self._verify_part(*pfd), parts))
            self.verified_bytes = sum(f["bytes"] for _, f, _ in parts)

    def _mix_in(self, old: list[Ref], share: float, seed: int) -> None:
        import random

        n = len(self.refs)
        want = round(n * share / (1 - share)) if share < 1 else len(old)
        picked = sorted(random.Random(seed).sample(range(len(old)), min(want, len(old))))
        self.refs += [old[i] for i in picked]
        self.mix = {"new_samples": n, "old_samples": len(picked), "old_available": len(old),
                    "old_share": round(len(picked) / (n + len(picked)), 4)}
        self.identity.append({"mix": self.mix, "seed": seed})  # another mix is another training set

    def _verify_part(self, part: Path, f: dict, d: Path, chunk_elems: int = 32 << 20) -> None:
        got = sha256_file(part)
        if got != f["sha256"]:
            raise StageError(f"{part}: sha256 {got[:16]}... differs from {f['sha256'][:16]}... recorded in "
                             f"{d / 'manifest.json'}: the file changed on disk after extraction (a flipped bit, a partial "
                             f"copy, an edit); {_rerun(d)}")
        st = self._handle(part)
        fp8 = "aux_scale" in st.keys()
        for name in ("aux", "final"):
            rows, cols = st.get_slice(name).get_shape()
            step = max(1, chunk_elems // max(cols, 1))
            for a in range(0, rows, step):
                x = st.get_slice(name)[a: a + step]
                if fp8:  # q * scale is finite iff q is not NaN (e4m3 has no inf) and the scale is finite
                    bad = ((x.view(torch.uint8) & 0x7F) == 0x7F).any(-1)
                    bad |= ~torch.isfinite(st.get_slice(f"{name}_scale")[a: a + step]).all(-1)
                else:
                    bad = ~torch.isfinite(x).all(-1)
                if bool(bad.any()):
                    row = a + int(bad.nonzero()[0, 0])
                    raise StageError(f"{part}: tensor {name!r} holds NaN or inf (first at token row {row}): training on "
                                     f"it would make the drafter NaN. The target overflowed while extracting (try dtype "
                                     f"bfloat16 or float32 instead of float16) or the shard is damaged; {_rerun(d)}")

    def _handle(self, part: Path):
        from safetensors import safe_open

        h = self._handles.get(part)
        if h is None:
            h = self._handles[part] = safe_open(str(part), "pt")
        return h

    def _check_part(self, part: Path, tokens: int, hidden: int) -> None:
        st = self._handle(part)
        want = {"input_ids": [tokens], "loss_mask": [tokens], "aux": [tokens, 3 * hidden], "final": [tokens, hidden]}
        if "aux_scale" in st.keys() or "final_scale" in st.keys():  # format v2: fp8 states and their scales
            want.update(aux_scale=[tokens, 3], final_scale=[tokens, 1])
        else:
            self.all_fp8 = False
        for name, shape in want.items():
            if name not in st.keys():
                raise StageError(f"{part}: tensor {name!r} is missing")
            got = list(st.get_slice(name).get_shape())
            if got != shape:
                raise StageError(f"{part}: tensor {name!r} has shape {got}, expected {shape} for a target with "
                                 f"hidden size {hidden}: the hidden states do not match the target")

    def read(self, ref: Ref, stored: bool = False) -> dict[str, torch.Tensor]:
        """A sample's tensors; hidden states in float32 (fp8 dequantized), or with `stored` as stored: fp8
        with their `aux_scale` and `final_scale` (see `on_device`)."""
        st = self._handle(ref.part)
        sl = slice(ref.offset, ref.offset + ref.length)
        out = {k: st.get_slice(k)[sl] for k in ("input_ids", "loss_mask", "aux", "final")}
        if out["aux"].dtype == torch.float8_e4m3fn:  # format v2
            for k in ("aux", "final"):
                if stored:
                    out[f"{k}_scale"] = st.get_slice(f"{k}_scale")[sl]
                else:
                    out[k] = dequantize_fp8(out[k], st.get_slice(f"{k}_scale")[sl])
        return out

    @property
    def tokens(self) -> int:
        return sum(r.length for r in self.refs)


class _Rows:
    """Rows of at most `cap` tokens, each sample into the first of the `window` open rows it fits; a sample
    that fits none opens a row and closes the oldest. Window 1 is next-fit: a row closes when the next sample
    does not fit (the plans' order before windows)."""

    def __init__(self, cap: int, window: int):
        self.cap, self.window, self.open = cap, max(1, window), []  # [[sample ids], tokens]

    def add(self, i: int, ln: int) -> list[list[int]]:
        """Place sample i of ln tokens; returns the rows this closes."""
        for row in self.open:
            if row[1] + ln <= self.cap:
                row[0].append(i)
                row[1] += ln
                return []
        self.open.append([[i], ln])
        closed = []
        while len(self.open) > self.window:
            closed.append(self.open.pop(0)[0])
        return closed

    def rest(self) -> list[list[int]]:
        rows, self.open = [r[0] for r in self.open], []
        return rows


def plan_batches(n_refs: list[int], epoch: int, seed: int, row_tokens: int, rows_per_batch: int,
                 window: int = 1) -> list[list[list[int]]]:
    """Batches of rows of sample indices. n_refs[i] = length of sample i. Deterministic in (seed, epoch).

    Whole conversations: with rows_per_batch > 1, a sample longer than row_tokens is not cut at the row but
    goes whole into a wide row of rows_per_batch x row_tokens tokens (a batch of that one row: the same tokens
    per step), shared with other long samples; only beyond that width is it truncated (as every sample longer
    than row_tokens is with rows_per_batch 1). `window`: open rows a sample may go into (first fit), 1 =
    next-fit; more packs fuller rows, which pays where rows are padded to a fixed shape (the GPU path)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(n_refs), generator=g).tolist()
    wide_cap = row_tokens * rows_per_batch
    rows, wide = _Rows(row_tokens, window), _Rows(wide_cap, window)
    batches: list[list[list[int]]] = []
    pending: list[list[int]] = []

    def emit(closed):
        nonlocal pending
        for row in closed:
            pending.append(row)
            if len(pending) == rows_per_batch:
                batches.append(pending)
                pending = []

    for i in order:
        if rows_per_batch > 1 and n_refs[i] > row_tokens:
            batches.extend([row] for row in wide.add(i, min(n_refs[i], wide_cap)))
        else:
            emit(rows.add(i, min(n_refs[i], row_tokens)))
    emit(rows.rest())
    if pending:
        batches.append(pending)
    batches.extend([row] for row in wide.rest())
    return batches


def batch_shape(row_lengths: list[list[int]], row_tokens: int, rows_per_batch: int) -> tuple[int, int]:
    """(rows, tokens per row) of a batch padded to its fixed shape: [rows_per_batch, row_tokens], or
    [1, rows_per_batch x row_tokens] for a wide row of long samples (see plan_batches)."""
    if rows_per_batch > 1 and len(row_lengths) == 1 and max(row_lengths[0]) > row_tokens:
        return 1, row_tokens * rows_per_batch
    return rows_per_batch, row_tokens


def batch_tokens(lengths: list[int], rows: list[list[int]], row_tokens: int, rows_per_batch: int) -> int:
    """The real (non-padding) tokens of a batch as `collate` packs it, from the plan alone."""
    cap = batch_shape([[lengths[i] for i in row] for row in rows], row_tokens, rows_per_batch)[1]
    return sum(min(sum(min(lengths[i], cap) for i in row), cap) for row in rows)


def collate(data: ShardSet, rows: list[list[int]], row_tokens: int, labels: list | None = None,
            rows_per_batch: int = 1, pad: bool = False, pin: bool = False,
            stored: bool = False) -> dict[str, torch.Tensor]:
    """Pack rows into [B, T] tensors; `doc` numbers the samples in a row (-1 = padding), `pos` restarts at 0
    for each sample, as the engines' positions do. `labels` (per sample) add `t_draft`. `pad`: the batch's
    fixed shape (`batch_shape`, rows rounded up to a multiple of 128: the attention's tile), so that compiled
    GPU code sees few shapes; else as short as its longest row. `pin`: page-locked, for an asynchronous copy
    to the GPU. `stored`: fp8 hidden states stay fp8 beside their scales (`on_device` dequantizes them).
    Samples read without `aux` and `final` (online training: the target computes them on the device) give the
    tokens and layout alone."""
    n_rows, cap = batch_shape([[data.refs[i].length for i in row] for row in rows], row_tokens, rows_per_batch)
    stored = stored and data.all_fp8  # a batch of mixed formats is dequantized on the host
    samples = [[data.read(data.refs[i], stored) for i in row] for row in rows]
    T = -(-cap // 128) * 128 if pad else min(cap, max(sum(min(s["input_ids"].shape[0], cap) for s in row)
                                                       for row in samples))
    B = n_rows if pad else len(rows)
    first = samples[0][0]
    states = [k for k in ("aux", "final") if k in first]  # none: tokens only (online: the target fills them in)

    def new(shape, dtype, fill=None):
        t = torch.empty(shape, dtype=dtype, pin_memory=pin)
        return t if fill is None else t.fill_(fill)

    out = {"input_ids": new((B, T), torch.long, 0), "loss_mask": new((B, T), torch.bool, False),
           **{k: new((B, T, first[k].shape[1]), first[k].dtype) for k in states},
           "doc": new((B, T), torch.long, -1), "pos": new((B, T), torch.long, 0)}
    if labels is not None:
        out["t_draft"] = new((B, T), torch.long, -1)
    scaled = [k for k in ("aux_scale", "final_scale") if k in first]
    for k in scaled:
        out[k] = new((B, T, first[k].shape[1]), first[k].dtype, 0)
    # packed as bytes: the float8 dtypes lack CPU fills; a zero byte is 0.0 in e4m3 (and its padding scale is 0)
    raw = {k: out[k].view(torch.uint8) if out[k].dtype == torch.float8_e4m3fn else out[k] for k in states}
    for b in range(B):
        o = 0
        for d, s in enumerate(samples[b] if b < len(samples) else []):
            ln = min(s["input_ids"].shape[0], cap - o)
            if ln <= 0:
                break
            out["input_ids"][b, o:o + ln] = s["input_ids"][:ln]
            out["loss_mask"][b, o:o + ln] = s["loss_mask"][:ln].bool()
            for k in states:
                raw[k][b, o:o + ln] = s[k][:ln].view(raw[k].dtype)
            for k in scaled:
                out[k][b, o:o + ln] = s[k][:ln]
            out["doc"][b, o:o + ln] = d
            out["pos"][b, o:o + ln] = torch.arange(ln)
            if labels is not None:
                out["t_draft"][b, o:o + ln] = labels[rows[b][d]][:ln]
            o += ln
        for k in states:  # padding: finite (a NaN there would reach the weight gradients as 0 * NaN)
            raw[k][b, o:] = 0
    return out


def on_device(batch: dict) -> dict:
    """A batch made with `stored` (fp8 states and their scales), once on its device: the states dequantized
    there, in float32 as `ShardSet.read` gives them; any other batch as it is."""
    for k in ("aux", "final"):
        if f"{k}_scale" in batch:
            batch[k] = dequantize_fp8(batch[k], batch.pop(f"{k}_scale"))
    return batch
