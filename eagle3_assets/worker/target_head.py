"""The pieces of the target that drafter training needs, read straight from its safetensors (no need to
load an 8B model to train a 0.5B head): token embeddings, final norm, lm_head."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import StageError

_NAMES = {
    "embed": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight"),
    "norm": ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"),
    "lm_head": ("lm_head.weight", "model.lm_head.weight"),
}


def _locate(path: Path) -> dict[str, Path]:
    """tensor name -> file, through the sharded index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def load_target_head(path: Path, eps: float) -> "TargetHead":
    from safetensors import safe_open

    where = _locate(path)
    got = {}
    for part, names in _NAMES.items():
        name = next((n for n in names if n in where), None)
        if name is None:
            if part == "lm_head":  # tied embeddings
                continue
            raise StageError(f"target {path}: none of the tensors {list(names)} is in its safetensors files; "
                             "the drafter needs the target's embeddings and final norm")
        with safe_open(str(where[name]), "pt") as st:
            got[part] = st.get_tensor(name)
    return TargetHead(got["embed"], got["norm"], got.get("lm_head", got["embed"]), eps)


def load_target_layer(path: Path, layer: int) -> dict[str, torch.Tensor]:
    """One decoder layer's weights, named as in the layer (`self_attn.q_proj.weight`, `mlp.up_proj.weight`...)."""
    from safetensors import safe_open

    where = _locate(path)
    out = {}
    for prefix in (f"model.layers.{layer}.", f"model.language_model.layers.{layer}."):
        for name, f in where.items():
            if name.startswith(prefix):
                with safe_open(str(f), "pt") as st:
                    out[name[len(prefix):]] = st.get_tensor(name)
        if out:
            return out
    raise StageError(f"target {path}: no tensors of decoder layer {layer} in its safetensors files")


class TargetHead(torch.nn.Module):
    """Frozen: final hidden (pre-norm) -> the target's logits."""

    def __init__(self, embed, norm, lm_head, eps):
        super().__init__()
        self.embed = embed
        self.norm_weight = torch.nn.Parameter(norm, requires_grad=False)
        self.lm_head = torch.nn.Parameter(lm_head, requires_grad=False)
        self.eps = eps

    def forward(self, final: torch.Tensor, draft_only: bool = False) -> torch.Tensor:
        """The target's logits; `draft_only`: just the draft vocab's columns (see `restrict`), 6x cheaper for
        a 49k-token target vocab and an 8k draft vocab."""
        x = final.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (self.norm_weight * x.to(self.norm_weight.dtype))
        w = self.draft_lm_head if draft_only else self.lm_head
        return x.to(w.dtype) @ w.T

    def restrict(self, target_ids: torch.Tensor) -> None:
        """Keep the lm_head rows of the draft vocab (call again after moving the head)."""
        self.draft_lm_head = self.lm_head.detach()[target_ids.to(self.lm_head.device)]
