"""Stage `vocab`: the draft vocabulary. The K most frequent target tokens among loss-masked (assistant)
positions of the training conversations, ties broken by id, sorted ascending; `d2t[i]` is the offset
(target id = i + d2t[i]) and `t2d` a bool mask over the target vocab: the layout SpecForge, speculators,
vLLM and SGLang all use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq

from ..errors import StageError
from ..files import atomic_file, require_file, resolve, sha256_file

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.vocab import VocabArgs


def build_mapping(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """counts[t] = frequency of target token t. Returns (draft->target ids, d2t offsets, t2d mask)."""
    vocab = counts.shape[0]
    k = min(draft_vocab_size, vocab)
    ids = np.arange(vocab)
    order = np.lexsort((ids, -counts))  # by frequency desc, then id asc: deterministic
    seen = order[counts[order] > 0][:k]
    if len(seen) < k:  # pad with the lowest unused ids, as SpecForge does
        unused = ids[np.isin(ids, seen, invert=True)]
        seen = np.concatenate([seen, unused[: k - len(seen)]])
    used = np.sort(seen).astype(np.int64)
    d2t = used - np.arange(k, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[used] = True
    return used, d2t, t2d


def run(workdir: str, args: VocabArgs, reporter) -> None:
    import torch
    from safetensors.torch import save_file

    from ..target.model import load_config, text_config

    conversations = require_file(resolve(workdir, args.conversations), "regenerated conversations",
                                 "materialize the conversations asset first")
    out = resolve(workdir, args.out)
    vocab = int(text_config(load_config(resolve(workdir, args.target))).vocab_size)
    requested = int(args.draft_vocab_size)
    if requested <= 0:
        raise StageError(f"draft_vocab_size must be positive, got {requested}")

    table = pq.read_table(conversations, columns=["input_ids", "loss_mask"])
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(bool)
    if ids.size and ids.max() >= vocab:
        raise StageError(f"conversations hold token id {int(ids.max())} but the target vocab has {vocab} ids: "
                         "they were tokenized for another model; rematerialize conversations with this target")
    counts = np.bincount(ids[mask], minlength=vocab)
    if counts.sum() == 0:
        raise StageError(f"{conversations} has no loss-masked tokens: no assistant turns to learn from")
    used, d2t, t2d = build_mapping(counts, requested)
    with atomic_file(out) as tmp:
        save_file({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, str(tmp),
                  metadata={"target_vocab_size": str(vocab), "draft_vocab_size": str(len(used))})
    coverage = float(counts[used].sum() / counts.sum())
    meta = {
        "path": str(out),
        "draft_vocab_size": int(len(used)),
        "requested_draft_vocab_size": requested,
        "target_vocab_size": vocab,
        "loss_tokens_counted": int(counts.sum()),
        "distinct_tokens_seen": int((counts > 0).sum()),
        "coverage": round(coverage, 6),  # share of assistant tokens the draft vocab can express
    }
    version = sha256_file(out)[:32]
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({**meta, "data_version": version})
