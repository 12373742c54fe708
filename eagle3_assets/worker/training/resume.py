"""Which run a checkpoint belongs to: a fingerprint of its inputs by content, settings and training code, and
the state to resume only when the fingerprint is this run's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...stages.train import HYPERPARAMETERS
from ..files import hash_files, sha256_file
from ..target.model import weight_files
from .data import ShardSet

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.train import TrainArgs

# The modules whose code decides the trained weights: a change to any of them invalidates a checkpoint.
# (paths under worker/)
TRAINING_CODE = ("training/trainer", "training/data", "training/schedule", "training/evaluate", "training/ttt_loss",
                 "training/drafter", "training/chain_attention", "target/head", "training/distributed",
                 "training/checkpoint", "training/online", "hidden_states/extract")


def fingerprint(hp: TrainArgs, bf16: bool, target: Path, data: ShardSet, shard_names: list[str], vocab: Path | None,
                init_dir: Path | None, pack_window: int = 1) -> dict:
    """What a checkpoint's run was made of, by content, one entry per input (so a mismatch can be named).
    Offline, the shards; online (`data.kind`), the conversations the target computes the hidden states from
    (their sha256, the samples' cut, the aux layers, the target's dtype) beside the target's weights.
    Cheap: shard contents by the hashes their manifests record (verified against the files by ShardSet),
    the target's and a finetune start's weights by `hash_files` (cached beside each file), the vocab file
    (a few MB) read once."""
    worker = Path(__file__).resolve().parent.parent
    code = hashlib.sha256(torch.__version__.encode())
    for m in TRAINING_CODE:
        code.update((worker / f"{m}.py").read_bytes())
    fp = {"hyperparameters": {**{k: getattr(hp, k) for k in HYPERPARAMETERS}, "bf16_compute": bool(bf16),
                              **({"pack_window": pack_window} if pack_window != 1 else {})},
          "training code": code.hexdigest()[:32],
          "target weights": hash_files(weight_files(target))[:32],
          "vocab": sha256_file(vocab)[:32] if vocab is not None else None,
          "init_from weights": None,
          "hidden states": getattr(data, "kind", "offline")}
    if init_dir is not None:
        from .checkpoint import weights_hash

        fp["init_from weights"] = weights_hash(init_dir) + sha256_file(init_dir / "config.json")[:16]
    label = "shard" if fp["hidden states"] == "offline" else "online from conversations"
    for name, ident in zip(shard_names, data.identity):
        fp[f"{label} {name}"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    return fp


def fingerprint_changes(old, new: dict) -> list[str]:
    """What differs between two fingerprints, in words; [] = the same run."""
    if not isinstance(old, dict):
        return ["the checkpoint format (written by an older version)"]
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) == new.get(k):
            continue
        if k == "hyperparameters" and isinstance(old.get(k), dict):
            keys = sorted(x for x in set(old[k]) | set(new[k]) if old[k].get(x) != new[k].get(x))
            out.append("hyperparameters (" + ", ".join(f"{x} {old[k].get(x)!r} -> {new[k].get(x)!r}" for x in keys) + ")")
        elif k not in old or k not in new:
            out.append(f"{k} ({'added' if k in new else 'removed'})")
        else:
            out.append(f"{k} (content)")
    return out


def resumable_state(ckpts: Path, fp: dict, device: str, reporter):
    """The latest checkpoint's state if it belongs to this very run, else None (the reason logged)."""
    latest = ckpts / "latest.json"
    if not latest.exists():
        return None
    try:
        info = json.loads(latest.read_text())
        changes = fingerprint_changes(info.get("fingerprint"), fp)
        if changes:
            reporter.log(f"not resuming {ckpts / info['checkpoint']} (step {info.get('step')}): "
                         f"{'; '.join(changes)} changed since it was written; training afresh", "warning")
            return None
        state = torch.load(ckpts / info["checkpoint"] / "training_state.pt", map_location=device, weights_only=False)
    except Exception as e:  # a damaged checkpoint is not worth failing the run for: it is only a shortcut
        reporter.log(f"not resuming from {ckpts}: its checkpoint cannot be read ({type(e).__name__}: {e}); "
                     "training afresh", "warning")
        return None
    if fingerprint_changes(state.get("fingerprint"), fp):
        reporter.log(f"not resuming {ckpts}: its training state disagrees with latest.json; training afresh", "warning")
        return None
    return state
