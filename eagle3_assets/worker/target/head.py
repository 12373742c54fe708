"""The pieces of the target that drafter training needs, read straight from its safetensors (no need to
load an 8B model to train a 0.5B head): token embeddings, final norm, lm_head."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import StageError

# plain causal LMs, transformers v5 multimodal wrappers (`model.language_model.*`), and the original layout
# of wrappers such as Kimi-K2.5 and llava (`language_model.model.*`, `language_model.lm_head`)
_NAMES = {
    "embed": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight", "embed_tokens.weight"),
    "norm": ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
             "norm.weight"),
    "lm_head": ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight"),
}
_LAYER_PREFIXES = ("model.layers.{}.", "model.language_model.layers.{}.", "language_model.model.layers.{}.")


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


def load_target_head(path: Path, eps: float) -> TargetHead:
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


def load_target_layer(path: Path, layer: int, need: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """One decoder layer's weights, named as in the layer (`self_attn.q_proj.weight`, `mlp.up_proj.weight`...).
    `need`: read only these, and raise ValueError before reading anything when one is absent (an MLA or MoE
    layer has no dense q/k/v or MLP: reading its hundreds of experts to find that out would cost GBs)."""
    from safetensors import safe_open

    where = _locate(path)
    for prefix in (p.format(layer) for p in _LAYER_PREFIXES):
        names = {n[len(prefix):]: n for n in where if n.startswith(prefix)}
        if not names:
            continue
        missing = [n for n in need if n not in names]
        if missing:
            raise ValueError(f"target layer {layer} has no {', '.join(missing)} (it is not a dense Llama-like layer)")
        out = {}
        for short, name in names.items():
            if not need or short in need:
                with safe_open(str(where[name]), "pt") as st:
                    out[short] = st.get_tensor(name)
        return out
    raise StageError(f"target {path}: no tensors of decoder layer {layer} in its safetensors files (looked for "
                     f"{', '.join(p.format(layer) for p in _LAYER_PREFIXES)}*)")


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
