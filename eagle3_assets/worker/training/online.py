"""Online hidden states (`hidden_states: online`): the target, loaded beside the drafter (the hf backend),
computes each training batch's aux and final hidden states under no_grad as training goes; nothing is written.

The samples are the regenerated conversations exactly as the extraction reads them (`load_samples`, shard after
shard: the same samples in the same order as the shards made of them), so the batch plan (`plan_batches` on their
lengths, seeded by (seed, epoch)) is the offline one, and a resumed run continues at its step. The states are
those the extraction stores (`HiddenStateCapture`: aux = outputs of the aux layers, final = the last layer's
output before the norm; right-padded batches of whole samples, `make_batches` and `pad_batch`), cut to what
each packed row keeps of a sample (under causal attention a prefix's states are the whole sample's), gathered
on the device and scattered into the packed [B, T] layout `collate` gives the tokens. The target's greedy
labels come from the same final states through its head, per batch (`target_labels` does it once, offline).

On a GPU the batches are made by the trainer's `Prefetcher`: a thread of its own runs the target's forward for
the next batches on a CUDA stream of its own while the drafter's step for this one runs on the default stream
(the step waits for a batch on the GPU through an event, not on the host). On a CPU a batch is made when asked.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch

from ...common.shard_format import LAYER_CONVENTION
from ..files import sha256_file
from ..hidden_states.extract import HiddenStateCapture, load_samples, make_batches, pad_batch
from ..shards.writer import Sample
from .data import Ref, batch_shape
from .evaluate import autocast, host_batch

LABEL_CHUNK = 4096  # tokens per pass through the target's full lm_head for the labels (the logits' memory)


class Conversations:
    """Every sample of the conversations file (no assistant token: left out, as the extraction does), tokens
    only; `read` gives a sample as `collate` reads one (no hidden states)."""

    all_fp8 = False

    def __init__(self, path: Path, max_length: int, chunk: int = 1024):
        self.path, self.max_length = path, int(max_length)
        n = pq.read_metadata(path).num_rows
        self.ids: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.truncated = 0
        for k in range(-(-n // chunk)):  # shard by shard, as the extraction reads them: ids kept compact
            samples, truncated = load_samples(path, k, chunk, self.max_length)
            self.truncated += truncated
            for s in samples:
                self.ids.append(torch.tensor(s.input_ids, dtype=torch.int32))
                self.masks.append(torch.tensor(s.loss_mask, dtype=torch.uint8))
        self.refs = [Ref(path, i, len(ids)) for i, ids in enumerate(self.ids)]

    @property
    def tokens(self) -> int:
        return sum(r.length for r in self.refs)

    def read(self, ref: Ref, stored: bool = False) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[ref.offset].long(), "loss_mask": self.masks[ref.offset]}


class OnlineStates:
    """The training data of an online run: the conversations' samples, their hidden states from the target.
    Quacks like a ShardSet where the trainer reads one (refs, tokens, identity, aux_layer_ids, `read`)."""

    kind = "online"
    all_fp8 = False
    verified_bytes = 0
    mix: dict = {}

    def __init__(self, convs: Conversations, target: Path, aux_layers: list[int], dtype: str, device: str,
                 batch_tokens: int):
        from ..target.model import load_model
        from ..target.size import check_fits

        check_fits(target, dtype, device)  # before a GB is loaded
        self.convs, self.refs = convs, convs.refs
        self.model = load_model(target, dtype, device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.capture = HiddenStateCapture(self.model, aux_layers)
        self.aux_layer_ids, self.batch_tokens, self.dtype_name = list(aux_layers), int(batch_tokens), dtype
        self.device = str(next(self.model.parameters()).device)
        self.identity = [{"conversations": sha256_file(convs.path), "samples": len(self.refs),
                          "max_length": convs.max_length, "aux_layer_ids": self.aux_layer_ids,
                          "layer_convention": LAYER_CONVENTION, "dtype": dtype, "target_batch_tokens": self.batch_tokens}]
        self.head = None

    @property
    def tokens(self) -> int:
        return self.convs.tokens

    def label_with(self, head, to_draft: torch.Tensor, dtype, bf16: bool) -> None:
        """The target's head (on the device, `restrict`ed) and the target id -> draft id map: each batch's
        `t_draft` is the target's greedy token as a draft id (-1: outside the draft vocab), as `target_labels`."""
        self.head, self.to_draft, self.label_dtype, self.bf16 = head, to_draft, dtype, bf16

    def read(self, ref: Ref, stored: bool = False) -> dict[str, torch.Tensor]:
        """One sample with its hidden states in float32 on the CPU, as `ShardSet.read` gives them (aux_rms_scale)."""
        out = self.convs.read(ref)
        with torch.no_grad():
            aux, final = self.capture(out["input_ids"][None].to(self.device))
        return {**out, "aux": aux[0].float().cpu(), "final": final[0].float().cpu()}

    # ---- batches: `host_batch` on the host (tokens, and the target forwards' plan), `finish` on the device
    def pieces(self, rows: list[list[int]], T: int, row_tokens: int, rows_per_batch: int,
               masks: bool = False) -> list[tuple[int, Sample]]:
        """(where the piece starts in the flat [B*T] batch, the sample cut to what its row keeps), in collate's
        packing; each piece's `row` is its place in the list; its loss mask the sample's with `masks` (an engine
        checks it), else empty (the target's forward needs none)."""
        _, cap = batch_shape([[self.refs[i].length for i in row] for row in rows], row_tokens, rows_per_batch)
        pieces = []
        for b, row in enumerate(rows):
            o = 0
            for i in row:
                ln = min(self.refs[i].length, cap - o)
                if ln <= 0:
                    break
                pieces.append((b * T + o, Sample(len(pieces), f"sample {i}", self.convs.ids[i][:ln].tolist(),
                                                 self.convs.masks[i][:ln].tolist() if masks else [])))
                o += ln
        return pieces

    def host_batch(self, rows: list[list[int]], row_tokens: int, loss_on: str, rows_per_batch: int,
                   pad: bool = False, pin: bool = False) -> dict:
        batch = host_batch(self.convs, rows, row_tokens, None, loss_on, rows_per_batch, pad=pad, pin=pin)
        pieces = self.pieces(rows, batch["input_ids"].shape[1], row_tokens, rows_per_batch)
        fwd, start, at = [], {}, 0
        for group in make_batches([s for _, s in pieces], self.batch_tokens):
            ids, valid, lengths = pad_batch(group)
            for s, ln in zip(group, lengths):
                start[s.row] = at
                at += ln
            fwd.append((ids.pin_memory(), valid.pin_memory()) if pin else (ids, valid))
        src = torch.cat([torch.arange(start[s.row], start[s.row] + len(s.input_ids)) for _, s in pieces])
        dest = torch.cat([torch.arange(d, d + len(s.input_ids)) for d, s in pieces])
        batch.update(_fwd=fwd, _src=src.pin_memory() if pin else src, _dest=dest.pin_memory() if pin else dest)
        return batch

    def finish(self, batch: dict) -> dict:
        """On the batch's device (on the prefetching thread's stream on a GPU): the target's forwards, their
        real tokens scattered into the packed layout (padding 0), and the labels."""
        dev = batch["input_ids"].device
        fwd, src, dest = batch.pop("_fwd"), batch.pop("_src"), batch.pop("_dest")
        # the target computes as the extraction does: in its own dtype, whatever autocast the caller is under
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            auxs, finals = [], []
            for ids, valid in fwd:
                aux, final = self.capture(ids.to(dev, non_blocking=True))
                valid = valid.to(dev, non_blocking=True)
                auxs.append(aux.flatten(0, 1).index_select(0, valid))
                finals.append(final.flatten(0, 1).index_select(0, valid))
                del aux, final
            aux, final = torch.cat(auxs).index_select(0, src), torch.cat(finals).index_select(0, src)
            del auxs, finals
        return self.packed(batch, aux, final, dest)

    def packed(self, batch: dict, aux: torch.Tensor, final: torch.Tensor, dest: torch.Tensor) -> dict:
        """The states of the batch's real tokens ([tokens, ...], in the order of `dest`) scattered into the packed
        [B, T] layout (padding 0), and each position's label: the target's greedy token as a draft id."""
        dev = batch["input_ids"].device
        B, T = batch["input_ids"].shape
        with torch.no_grad():
            t_draft = torch.full((B * T,), -1, dtype=torch.long, device=dev)
            with autocast(str(dev), self.bf16):
                for a in range(0, final.shape[0], LABEL_CHUNK):
                    logits = self.head(final[a: a + LABEL_CHUNK].to(self.label_dtype))
                    t_draft[dest[a: a + LABEL_CHUNK]] = self.to_draft[logits.argmax(-1)]
                    del logits
            batch["aux"] = aux.new_zeros(B * T, aux.shape[1]).index_copy_(0, dest, aux).view(B, T, -1)
            batch["final"] = final.new_zeros(B * T, final.shape[1]).index_copy_(0, dest, final).view(B, T, -1)
            batch["t_draft"] = t_draft.view(B, T)
        return batch

    def device_batch(self, rows: list[list[int]], row_tokens: int, loss_on: str, rows_per_batch: int,
                     pad: bool = False) -> dict:
        """A batch made and finished here, on the target's device (evaluation: no thread)."""
        batch = self.host_batch(rows, row_tokens, loss_on, rows_per_batch, pad=pad, pin=pad)
        return self.finish({k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                            for k, v in batch.items()})

    def close(self) -> None:
        self.capture.close()
