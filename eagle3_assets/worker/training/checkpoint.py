"""Drafter checkpoint directories: the tensor contract, our canonical directory, and reading any EAGLE-3
checkpoint (SpecForge/SGLang `midlayer.*`, speculators/vLLM `layers.0.*`) for a finetune.

The aux-layer-id conventions (the classic silent failure: acceptance collapses, no error):
- ours, SpecForge and SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`: "output of layer i";
- vLLM's and speculators' top-level `eagle_aux_hidden_state_layer_ids`: "capture before layer i" = ours + 1;
- no ids at all: both engines capture (2, N//2, N-3) before-layer = ours [1, N//2-1, N-4].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...common.shard_format import LAYER_CONVENTION, engine_default_aux_layers
from ..errors import StageError
from ..files import hash_files, replace_dir
from ..target.model import text_config
from .drafter import DraftConfig

ARCH = "LlamaForCausalLMEagle3"
_ACCEPTED_ARCHS = {ARCH, "Eagle3LlamaForCausalLM"}


def expected_tensors(c: DraftConfig) -> dict[str, list[int]]:
    H, I, d = c.hidden_size, c.intermediate_size, c.head_dim  # noqa: E741  (the paper's names)
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    later = {}  # layers after the first (vLLM's layers.{i}): plain Llama layers, H-wide attention input
    for i in range(1, c.num_hidden_layers):
        later.update({f"layers.{i}.input_layernorm.weight": [H], f"layers.{i}.post_attention_layernorm.weight": [H],
                      f"layers.{i}.self_attn.q_proj.weight": [q, H], f"layers.{i}.self_attn.k_proj.weight": [kv, H],
                      f"layers.{i}.self_attn.v_proj.weight": [kv, H], f"layers.{i}.self_attn.o_proj.weight": [H, q],
                      f"layers.{i}.mlp.gate_proj.weight": [I, H], f"layers.{i}.mlp.up_proj.weight": [I, H],
                      f"layers.{i}.mlp.down_proj.weight": [H, I]})
    return {
        **later,
        "fc.weight": [H, 3 * c.target_hidden_size],
        "midlayer.input_layernorm.weight": [H],
        "midlayer.hidden_norm.weight": [H],
        "midlayer.post_attention_layernorm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [q, 2 * H],
        "midlayer.self_attn.k_proj.weight": [kv, 2 * H],
        "midlayer.self_attn.v_proj.weight": [kv, 2 * H],
        "midlayer.self_attn.o_proj.weight": [H, q],
        "midlayer.mlp.gate_proj.weight": [I, H],
        "midlayer.mlp.up_proj.weight": [I, H],
        "midlayer.mlp.down_proj.weight": [H, I],
        "norm.weight": [H],
        "lm_head.weight": [c.draft_vocab_size, H],
        "d2t": [c.draft_vocab_size],
        "t2d": [c.vocab_size],
    }


def check_tensors(where: Path, tensors: dict[str, torch.Tensor], c: DraftConfig, *, require_t2d: bool = True) -> None:
    """Every name, shape and dtype of the contract; errors name the tensor."""
    want = expected_tensors(c)
    for name, shape in want.items():
        if name not in tensors:
            if name == "t2d" and not require_t2d:
                continue
            raise StageError(f"{where}: tensor {name!r} is missing (an EAGLE-3 drafter needs {sorted(want)})")
        got = list(tensors[name].shape)
        if got != shape:
            raise StageError(f"{where}: tensor {name!r} has shape {got}, expected {shape} "
                             f"(hidden {c.hidden_size}, target hidden {c.target_hidden_size}, draft vocab "
                             f"{c.draft_vocab_size}, target vocab {c.vocab_size})")
    if tensors["d2t"].dtype != torch.int64:
        raise StageError(f"{where}: tensor 'd2t' has dtype {tensors['d2t'].dtype}, expected torch.int64 offsets")
    if "t2d" in tensors and tensors["t2d"].dtype != torch.bool:
        raise StageError(f"{where}: tensor 't2d' has dtype {tensors['t2d'].dtype}, expected torch.bool")
    ids = torch.arange(c.draft_vocab_size) + tensors["d2t"]
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise StageError(f"{where}: tensor 'd2t' does not map the draft vocab onto distinct sorted ids of the "
                         f"{c.vocab_size}-token target vocab")
    for name, t in tensors.items():
        if name not in want:
            raise StageError(f"{where}: unexpected tensor {name!r}: SGLang silently ignores unknown names and vLLM "
                             "may reject them; the contract has exactly " + ", ".join(sorted(want)))
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise StageError(f"{where}: tensor {name!r} holds NaN or inf values")


def config_dict(c: DraftConfig, dtype: str, max_positions: int) -> dict:
    """A flat LlamaConfig for LlamaForCausalLMEagle3, the fields both engines read."""
    cfg = {
        "architectures": [ARCH], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": c.num_hidden_layers,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": max(c.max_position_embeddings, max_positions),
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "tie_word_embeddings": False, "torch_dtype": dtype,
        "attention_bias": False, "mlp_bias": False,
    }
    return cfg


def save_drafter_dir(model, out: Path, target_info: dict) -> None:
    """Our canonical checkpoint: fp32 (training precision, so a finetune continues exactly), `midlayer.*`
    names, d2t/t2d, and the aux layer ids in our own block, in our convention."""
    from safetensors.torch import save_file

    c: DraftConfig = model.config
    cfg = config_dict(c, "float32", c.max_position_embeddings)
    cfg["eagle3_assets"] = {"aux_layer_ids": c.aux_layer_ids, "layer_convention": LAYER_CONVENTION,
                            "target": target_info}
    tmp = out.with_name(f".tmp-{out.name}")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous().cpu() if v.is_floating_point() else v.cpu().contiguous()
               for k, v in model.export_state().items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    replace_dir(tmp, out)


def weights_hash(d: Path) -> str:
    return hash_files(sorted(d.glob("*.safetensors")))[:32]


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if files:
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(d.glob("*.bin"))
    if not bins:
        raise StageError(f"drafter checkpoint {d} holds no weights (*.safetensors or *.bin)")
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def _normalize_names(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in w.items():
        k = k.removeprefix("model.")
        if k.startswith("embed_tokens."):
            continue  # the target's, shared; never part of the drafter
        out[k.replace("layers.0.", "midlayer.", 1)] = v
    return out


# Where a checkpoint's config may name its aux layers, in lookup order: (field, whose convention, offset to ours).
_ID_FIELDS = (
    ("eagle3_assets.aux_layer_ids", "ours: output of layer i", 0),
    ("eagle_config.eagle_aux_hidden_state_layer_ids", "SpecForge/SGLang: output of layer i", 0),
    ("eagle_aux_hidden_state_layer_ids", "vLLM/speculators: capture before layer i", -1),
)


@dataclass
class AuxIds:
    """A checkpoint's aux layer ids: in our convention, and as its config writes them."""
    ours: list[int]
    field: str = ""  # "" = no ids in the config: the engines' defaults
    written: list[int] | None = None
    convention: str = "engine defaults: capture before layers (2, N//2, N-3)"
    offset: int = 0  # ours = written + offset

    def spelled(self, ours: list[int]) -> str:
        """How this config's field would write `ours`."""
        return f"{self.field} {[i - self.offset for i in ours]}" if self.field else "no ids, if they are the defaults"

    def describe(self) -> str:
        if not self.field:
            return f"{self.ours} (output of layer i; its config names no layers, so the {self.convention})"
        if self.written == self.ours:
            return f"{self.ours} (its config's {self.field}, {self.convention})"
        return f"{self.ours} in our output-of-layer numbering (its config's {self.field} says {self.written}, {self.convention})"


def read_aux_ids(cfg: dict, target_layers: int, model_type: str = "") -> AuxIds:
    """The aux layer ids a checkpoint was trained on, where its config keeps them and in whose convention
    (`model_type`: the target's text model, whose SGLang class may read eagle_config's ids its own way)."""
    from .. import engines

    found = []
    for field, convention, offset in _ID_FIELDS:
        v = cfg
        for key in field.split("."):
            v = v.get(key) if isinstance(v, dict) else None
        if v:
            for engine in engines.reading(field):  # an engine's dialect: read as that engine reads it
                if (rule := engine.id_rule([int(i) for i in v], model_type)) is not None:
                    offset, convention = rule
            found.append(AuxIds([int(i) + offset for i in v], field, [int(i) for i in v], convention, offset))
    if not found:  # no ids written: the engines read it as their defaults
        return AuxIds(engine_default_aux_layers(target_layers))
    if found[0].field.startswith("eagle_config") and len(found) > 1 and found[1].ours != found[0].ours:
        raise StageError(f"the drafter config names two different aux layer sets: {found[0].field} {found[0].written} "
                         f"({found[0].convention}) and {found[1].field} {found[1].written} ({found[1].convention}); "
                         f"{_readers(found[0].field)} reads the first, {_readers(found[1].field)} the second: keep the "
                         "one it was trained on")
    return found[0]


def _readers(field: str) -> str:
    from .. import engines

    return "/".join(e.TITLE for e in engines.reading(field)) or "another reader"


def aux_ids_from_config(cfg: dict, target_layers: int, model_type: str = "") -> list[int]:
    """The aux layer ids a checkpoint was trained on, in our (output-of-layer) convention."""
    return read_aux_ids(cfg, target_layers, model_type).ours


def check_finetune_layers(d: Path, ids: AuxIds, shard_ids: list[int], target_layers: int) -> None:
    """A drafter finetuned on other layers than it was trained on learns against its own fc: refuse it,
    advising only what can run on this target."""
    if list(ids.ours) == list(shard_ids):
        return
    outside = [i for i in ids.ours if not 0 <= i < target_layers]
    if outside or len(set(ids.ours)) != len(ids.ours):
        fix = (f"its layers {list(ids.ours)} (output of layer i) are not {len(ids.ours)} distinct layers of this "
               f"{target_layers}-layer target (ids 0..{target_layers - 1}"
               + (f"; {outside} outside it" if outside else "") + "), so it does not fit this target: train a new "
               "drafter (no init_from)")
    else:
        fix = f"Rematerialize hidden_state_shards with aux_layers {list(ids.ours)} (output of layer i)"
    raise StageError(f"drafter checkpoint {d} was trained on target layers {ids.describe()}, but the hidden-state "
                     f"shards hold layers {list(shard_ids)} (output of layer i): finetuning would feed it other layers "
                     f"than the ones its fc was trained on. {fix}, or pick a drafter trained on layers "
                     f"{list(shard_ids)} (in this config's convention: {ids.spelled(list(shard_ids))})")


_SPECULATORS_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def _from_speculators(d: Path, cfg: dict) -> dict:
    """A speculators-format EAGLE-3 config (`Eagle3Speculator`: the layer's fields under
    `transformer_layer_config`) as the flat config the rest reads, when it computes our draft's function."""
    if cfg.get("speculators_model_type") != "eagle3":
        raise StageError(f"drafter checkpoint {d}: speculators_model_type {cfg.get('speculators_model_type')!r} is not "
                         "an EAGLE-3 draft (eagle3)")
    # vLLM serves a speculators draft without the field as norm_before_residual=True
    flags = {"norm_before_residual": cfg.get("norm_before_residual", True), **{f: cfg.get(f) for f in _SPECULATORS_FLAGS}}
    on = [f"{k}={v}" for k, v in flags.items() if v]
    if on:
        raise StageError(f"drafter checkpoint {d}: its speculators config has {', '.join(on)}; this draft layer (and "
                         "SGLang's) normalises after taking the residual, with no extra norms, so finetuning it here "
                         "would change the function it computes. Finetune it with speculators, or start from a "
                         f"{ARCH} checkpoint")
    flat = dict(cfg.get("transformer_layer_config") or {})
    for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if cfg.get(k) is not None:
            flat[k] = cfg[k]
    flat["architectures"] = [ARCH]
    return flat


def load_drafter_dir(d: Path, tc) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """Read an EAGLE-3 checkpoint to finetune from; validate it against the target."""
    if not (d / "config.json").exists():
        raise StageError(f"drafter checkpoint {d} has no config.json")
    tc = text_config(tc)  # a wrapper's text model: what the drafter reads and predicts
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("speculators_model_type"):
        cfg = _from_speculators(d, cfg)
    archs = set(cfg.get("architectures") or [])
    if not archs & _ACCEPTED_ARCHS:
        raise StageError(f"drafter checkpoint {d}: architectures {sorted(archs)} is not an EAGLE-3 Llama draft "
                         f"({ARCH}, or a speculators Eagle3Speculator)")
    if cfg.get("vocab_size") not in (None, tc.vocab_size):
        raise StageError(f"drafter checkpoint {d}: field vocab_size is {cfg['vocab_size']} but the target vocab has "
                         f"{tc.vocab_size} ids: the drafter was made for another target")
    th = cfg.get("target_hidden_size") or cfg["hidden_size"]
    if th != tc.hidden_size:
        raise StageError(f"drafter checkpoint {d}: field target_hidden_size is {th} but the target's hidden size "
                         f"is {tc.hidden_size}: the drafter was made for another target")
    heads = cfg["num_attention_heads"]
    c = DraftConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                    num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
                    head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=cfg["rms_norm_eps"],
                    rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                    max_position_embeddings=cfg.get("max_position_embeddings", tc.max_position_embeddings),
                    vocab_size=tc.vocab_size, draft_vocab_size=cfg.get("draft_vocab_size") or tc.vocab_size,
                    target_hidden_size=th, aux_layer_ids=aux_ids_from_config(cfg, tc.num_hidden_layers, tc.model_type),
                    num_hidden_layers=int(cfg.get("num_hidden_layers") or 1))
    w = _normalize_names(_read_weights(d))
    if "t2d" not in w and "d2t" in w:  # ModelOpt exports omit t2d; it follows from d2t
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        ids = torch.arange(c.draft_vocab_size) + w["d2t"].long()
        t2d[ids.clamp(0, c.vocab_size - 1)] = True
        w["t2d"] = t2d
    if "d2t" in w:
        w["d2t"] = w["d2t"].long()
    check_tensors(d, w, c)
    return c, {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
