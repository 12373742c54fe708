"""Stage `export`: the drafter in the directory layout each engine (worker/engines/) loads as it stands, one
dialect per engine, each validated against its contract before it is published.

Aux layer ids: a drafter trained on the default layers gets no ids in its config (the engines then capture
exactly those layers); otherwise each dialect gets them in its engine's convention (`export_fields`), read
back as the engine reads them (`exported_layers`); each engine refuses what it would serve as another
function than the one trained (`export_fields`, `check_export`, `check_tensors`). Dialects not named
(`dialects` unset): every engine that can take the drafter, the others left out with the reason in the
metadata (`<dialect>_left_out`): a small target's default layers include its last, which SGLang never
captures, and for SGLang's DeepSeek-family classes no first layer of 0 means the same to every release."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...common.shard_format import engine_default_aux_layers
from .. import engines
from ..errors import StageError
from ..files import replace_dir, require_file, resolve
from ..target.model import load_config, text_config
from ..training.checkpoint import ARCH, aux_ids_from_config, config_dict, load_drafter_dir, weights_hash

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.export import ExportArgs

# speculators-era flags that the plain EAGLE-3 layer of these engines does not implement
_FOREIGN_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "sliding_window")


def layer_fields(dialect: str, aux: list[int], num_layers: int, model_type: str = "") -> dict:
    """The config fields that make the engine capture `aux` (ours); none for the default layers."""
    if aux == engine_default_aux_layers(num_layers):
        return {}
    return engines.get(dialect).export_fields(aux, model_type, num_layers)


def engine_capture_layers(dialect: str, cfg: dict, num_layers: int, model_type: str = "") -> list[int]:
    """Which target layers (our convention) the engine will capture for this config: what it reads, as it
    reads it (the engine's `exported_layers`; none named: the default)."""
    ours = engines.get(dialect).exported_layers(cfg, model_type)
    return ours if ours is not None else engine_default_aux_layers(num_layers)


def validate_export(d: Path, dialect: str, tc, aux: list[int]) -> dict:
    """The contract of one export directory; returns what was checked, raises naming the offending field."""
    from safetensors.torch import load_file

    tc = text_config(tc)  # a wrapper's (Kimi-K2.5's) text model: its vocab, width and layer count
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("architectures") != [ARCH]:
        raise StageError(f"{d}: config field architectures is {cfg.get('architectures')}, must be [{ARCH!r}]")
    for f in ("draft_vocab_size", "target_hidden_size"):
        if f not in cfg:
            raise StageError(f"{d}: config field {f!r} is missing")
    if cfg["target_hidden_size"] != tc.hidden_size or cfg["vocab_size"] != tc.vocab_size:
        raise StageError(f"{d}: config fields target_hidden_size/vocab_size ({cfg['target_hidden_size']}, "
                         f"{cfg['vocab_size']}) do not match the target ({tc.hidden_size}, {tc.vocab_size})")
    if cfg.get("max_position_embeddings", 0) < tc.max_position_embeddings:
        raise StageError(f"{d}: config field max_position_embeddings {cfg.get('max_position_embeddings')} is below the "
                         f"target's {tc.max_position_embeddings}: rotary lookups past it go out of bounds in vLLM")
    bad = [f for f in _FOREIGN_FLAGS if f in cfg]
    if bad:
        raise StageError(f"{d}: config fields {bad} are not understood by the plain EAGLE-3 layer of vLLM/SGLang")
    captured = engine_capture_layers(dialect, cfg, tc.num_hidden_layers, tc.model_type)
    if captured != list(aux):
        raise StageError(f"{d}: {dialect} would capture target layers {captured} (output-of-layer) but the drafter was "
                         f"trained on {list(aux)}: acceptance would collapse without an error")
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if any("embed_tokens" in k for k in tensors):
        raise StageError(f"{d}: holds embed_tokens; the engines share the target's embeddings, drop it")
    engines.get(dialect).check_tensors(d, sorted(tensors))
    load_drafter_dir(d, tc)  # the tensor contract: names, shapes, dtypes
    return {"tensors": len(tensors), "captured_layers": captured, "config_keys": sorted(cfg)}


def write_export(src: Path, out: Path, dialect: str, tc) -> dict:
    from safetensors.torch import save_file

    tc = text_config(tc)
    c, w = load_drafter_dir(src, tc)
    cfg = config_dict(c, "bfloat16", tc.max_position_embeddings)
    fields = layer_fields(dialect, c.aux_layer_ids, tc.num_hidden_layers, tc.model_type)
    cfg.update(fields)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in w.items()}
    tmp = out.with_name(f".tmp-{out.name}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    checked = validate_export(tmp, dialect, tc, c.aux_layer_ids)
    replace_dir(tmp, out)
    return {"path": str(out), "layer_ids": json.dumps(fields) if fields else "omitted (engine defaults)",
            "bytes": sum(p.stat().st_size for p in out.iterdir()), **checked}


def engine_view(d: Path) -> dict[str, torch.Tensor]:
    """A drafter directory's tensors as vLLM and SGLang load them, named as our checkpoint names them: the
    `model.` prefix and `layers.0.`/`midlayer.` (vLLM renames one to the other) mapped away, the target's shared
    embeddings and t2d (neither engine loads them) dropped; each tensor in the dtype it is stored in."""
    from ..training.checkpoint import _normalize_names, _read_weights

    return {k: v for k, v in _normalize_names(_read_weights(d)).items() if k != "t2d"}


def _blocks_order(served: torch.Tensor, trained: torch.Tensor) -> list[int] | None:
    """fc.weight takes concat(low, mid, high aux states): for each of the served matrix's three column blocks,
    the trained block it equals; None when they are not the trained blocks in some order."""
    if served.dim() != 2 or served.shape[1] % 3:
        return None
    s, t = served.chunk(3, dim=1), trained.chunk(3, dim=1)
    order = [next((j for j in range(3) if torch.equal(s[i], t[j])), None) for i in range(3)]
    return order if None not in order and sorted(order) == [0, 1, 2] else None


def compare_export(export_dir: Path, trained_dir: Path) -> dict:
    """The export as the engine reads it (`engine_view`) against the trained checkpoint, tensor by tensor, each
    trained tensor cast to the export's stored dtype first (the export's own cast: an exact match is due).
    {"same": True, "tensors": n} or {"same": False, "tensor": the first that differs, "why": what differs}."""
    served, trained = engine_view(Path(export_dir)), engine_view(Path(trained_dir))
    missing, extra = sorted(set(trained) - set(served)), sorted(set(served) - set(trained))
    if missing or extra:
        return {"same": False, "tensor": (missing or extra)[0],
                "why": (f"it lacks {missing}" if missing else "") + ("; " if missing and extra else "")
                + (f"it holds {extra}, which the trained drafter has not" if extra else "")}
    for name in sorted(trained, key=lambda n: (n != "fc.weight", n)):  # fc first: the aux blocks' order
        s, t = served[name], trained[name]
        if s.shape != t.shape:
            return {"same": False, "tensor": name, "why": f"shape {list(s.shape)} against {list(t.shape)}"}
        t = t.to(s.dtype)
        if torch.equal(s, t):
            continue
        diff = (s.double() - t.double()).abs()
        why = f"max abs diff {diff.max().item():.4g}, {int((diff > 0).sum())} of {diff.numel()} values differ"
        order = _blocks_order(s, t) if name == "fc.weight" else None
        if order is not None:
            why += (f"; the aux blocks appear reordered: its column blocks hold the trained drafter's blocks {order} "
                    "(0 = the lowest aux layer's), so every aux state meets another layer's weights")
        return {"same": False, "tensor": name, "why": why}
    return {"same": True, "tensors": len(trained)}


# The config keys write_export changes by design, which make no other drafter: the stored precision (the tensors
# are compared by compare_export) and the aux layer ids' fields (our block dropped, the engine's own written: compared
# as the layers the engine captures instead)
_STORAGE_KEYS = ("torch_dtype", "dtype")
_MISSING = "missing"


def _layer_keys() -> set[str]:
    return {"eagle3_assets"} | {engines.get(n).LAYER_IDS_FIELD.split(".")[0] for n in engines.NAMES}


def compare_config(export_dir: Path, trained_dir: Path, dialect: str, tc) -> list[dict]:
    """The export's config.json against the trained checkpoint's, key by key, where they differ other than as
    write_export makes them differ: [{"key", "export", "checkpoint"}], a side that lacks the key "missing"; the aux
    layers compared as `dialect`'s engine captures them (our convention) against those trained on;
    max_position_embeddings only where the export's is below the checkpoint's (the export raises it to the
    target's). Empty: the export's config makes the trained drafter."""
    tc = text_config(tc)
    served = json.loads((Path(export_dir) / "config.json").read_text())
    trained = json.loads((Path(trained_dir) / "config.json").read_text())
    skip = _layer_keys() | set(_STORAGE_KEYS)
    out = []
    for key in sorted((set(served) | set(trained)) - skip):
        e, c = served.get(key, _MISSING), trained.get(key, _MISSING)
        if e == c or (key == "max_position_embeddings" and _MISSING not in (e, c) and e >= c):
            continue
        out.append({"key": key, "export": e, "checkpoint": c})
    captured = engine_capture_layers(dialect, served, tc.num_hidden_layers, tc.model_type)
    ours = aux_ids_from_config(trained, tc.num_hidden_layers, tc.model_type)
    if captured != list(ours):
        out.append({"key": f"aux layers ({dialect} captures, output of layer i)", "export": captured,
                    "checkpoint": list(ours)})
    return out


def _refusal(dialect: str, src: Path, src_cfg: dict, aux: list[int], tc) -> str | None:
    """Why `dialect` cannot take this drafter (its engine would serve another function than the one trained)."""
    try:
        layer_fields(dialect, aux, tc.num_hidden_layers, tc.model_type)
        engines.get(dialect).check_export(src, src_cfg)
    except StageError as e:
        return str(e)
    return None


def left_out(engine: str, target: Path, src: Path | None = None) -> dict[str, str]:
    """The engines other than `engine` that would refuse to take the drafter at `src` (None: one trained on this
    target's default aux layers, one draft layer: the gate's, before it is trained), with the export's reason:
    the engines no refusal may advise. From the target's config.json alone (a preflight needs no weights)."""
    from transformers import AutoConfig

    from ...common.shard_format import default_aux_layers

    try:
        tc = text_config(AutoConfig.from_pretrained(str(target)))
    except (OSError, ValueError, KeyError):
        return {}  # transformers cannot read it: the stage that loads the target says why
    if src is not None and (src / "config.json").exists():
        cfg = json.loads((src / "config.json").read_text())
        aux = aux_ids_from_config(cfg, tc.num_hidden_layers, tc.model_type)
    else:
        cfg, aux = {"num_hidden_layers": 1}, default_aux_layers(tc.num_hidden_layers)
    return {d: why for d in engines.NAMES
            if d != engine and (why := _refusal(d, src or Path("drafter"), cfg, aux, tc)) is not None}


def run(workdir: str, args: ExportArgs, reporter) -> None:
    src = resolve(workdir, args.drafter)
    out = resolve(workdir, args.out)
    tc = text_config(load_config(resolve(workdir, args.target)))
    asked = args.dialects  # None: every engine that can take the drafter, the others left out and said why
    dialects = asked or list(engines.NAMES)
    unknown = [x for x in dialects if x not in engines.NAMES]
    if unknown:
        raise StageError(f"unknown export dialects {unknown}; choose from {list(engines.NAMES)}")
    src_cfg = json.loads(require_file(src / "config.json", "drafter config", "train the drafter first").read_text())
    aux = aux_ids_from_config(src_cfg, tc.num_hidden_layers, tc.model_type)
    # refusals checked before any dialect is written
    left_out = {d: why for d in dialects if (why := _refusal(d, src, src_cfg, aux, tc)) is not None}
    if left_out and (asked or len(left_out) == len(dialects)):
        raise StageError(" ".join(left_out.values()))
    dialects = [d for d in dialects if d not in left_out]
    meta = {}
    for dialect, why in left_out.items():
        reporter.log(f"no {dialect} export: {why}")
        meta[f"{dialect}_left_out"] = why
    for dialect in dialects:
        info = write_export(src, out / dialect, dialect, tc)
        reporter.log(f"{dialect} export: {info['path']} ({info['tensors']} tensors, layer ids {info['layer_ids']})")
        meta[f"{dialect}_path"] = info["path"]
        meta[f"{dialect}_layer_ids"] = info["layer_ids"]
        meta[f"{dialect}_bytes"] = info["bytes"]
    meta["dialects"] = ", ".join(dialects)
    meta["source"] = str(src)
    meta["validated"] = True
    version = weights_hash(out / dialects[0])
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({**meta, "data_version": version})
