"""The target model, a local Hugging Face causal-LM directory (or a multimodal wrapper of one): validation,
its text config, and loading it, its decoder stack and its tokenizer, for every stage that reads it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..errors import StageError

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def load_config(path: Path):
    """Validate that `path` is a local HF causal-LM directory, or a multimodal wrapper (Kimi-K2.5's
    `kimi_k25`, a llava) whose text model is a causal LM, and return its config."""
    if not path.exists():
        raise StageError(f"target model directory {path} does not exist on the host: set target_model's "
                         "path to a local Hugging Face model directory, or leave it empty for the embedded SmolLM2")
    if not (path / "config.json").exists():
        raise StageError(f"target model directory {path} has no config.json: it is not a Hugging Face model directory")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise StageError(f"target model {path}: config.json cannot be read by transformers: {e}") from e
    archs = list(getattr(cfg, "architectures", None) or [])
    causal = cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        not archs or any(a.endswith(_CAUSAL_SUFFIXES) for a in archs))
    tc = text_config(cfg)
    # a wrapper's text model counts by its config class: Kimi's text_config says model_type `kimi_k2`, which
    # transformers reads as a DeepseekV3Config
    wrapped = tc is not cfg and type(tc).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not (causal or wrapped):
        raise StageError(f"target model {path} is a {cfg.model_type!r} model (architectures {archs}), not a causal "
                         "language model: EAGLE-3 drafts for decoder-only generative targets; point target_model "
                         "at a *ForCausalLM checkpoint, or a multimodal one whose text_config is a causal LM")
    if not weight_files(path):
        raise StageError(f"target model directory {path} holds no weights (*.safetensors or *.bin)")
    return cfg


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    return files or sorted(path.glob("*.bin"))


def text_config(cfg):
    """Multimodal configs keep the language model's fields in a sub-config."""
    get = getattr(cfg, "get_text_config", None)
    return get() if get else cfg


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# Where wrappers keep their text model's tensors: the original checkpoints (Kimi-K2.5, llava-era) and
# transformers v5's own save format; renamed to a plain *ForCausalLM's names at load.
_TEXT_MODEL_NAMES = {r"^language_model\.model\.": "model.", r"^language_model\.lm_head\.": "lm_head.",
                     r"^model\.language_model\.": "model."}


def load_model(path: Path, dtype: str = "bfloat16", device: str = "auto"):
    """The target's causal LM. For a multimodal wrapper, its text model alone (the vision tower is never
    built: every stage reads or generates text only), with every text tensor checked present."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_config(path)
    tc = text_config(cfg)
    if tc is cfg:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        return model.to(pick_device(device)).eval()
    from .head import _locate

    tc = copy.deepcopy(tc)
    # transformers picks its weight conversions (e.g. fusing DeepSeek's per-expert tensors) by the
    # instance's model_type: Kimi's `kimi_k2` has none, which would leave every expert random
    tc.model_type = type(tc).model_type
    names = _locate(path)
    tc.tie_word_embeddings = not any(n in names for n in ("language_model.lm_head.weight", "lm_head.weight"))
    with _load_report() as report:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, config=tc, dtype=getattr(torch, dtype),
                                                               key_mapping=_TEXT_MODEL_NAMES, output_loading_info=True)
        except RuntimeError as e:  # e.g. an expert's tensor missing: the per-expert ones cannot be fused
            rows = [" ".join(ln.replace("|", " ").split()) for r in report for ln in r.splitlines()
                    if "| MISSING" in ln or "| CONVERSION" in ln]
            raise StageError(f"target {path}: transformers could not build its text model from the checkpoint's "
                             f"tensors: {'; '.join(dict.fromkeys(rows[:8]))} (the checkpoint lacks tensors of "
                             "those modules, or names them otherwise)") from e
    bad = sorted(info.get("missing_keys") or []) + sorted(str(k) for k in info.get("mismatched_keys") or [])
    if bad:
        raise StageError(f"target {path}: its text model ({type(model).__name__}) lacks the tensors {bad[:6]}"
                         f"{' ...' if len(bad) > 6 else ''} under the names tried ({', '.join(_TEXT_MODEL_NAMES)}); "
                         "they would be random. Save the checkpoint with one of those layouts")
    return model.to(pick_device(device)).eval()


@contextmanager
def _load_report():
    """transformers' load report (a warning), kept rather than printed: for a wrapper it lists every vision
    tensor as unexpected; when loading fails, its lines name the tensors at fault."""
    import logging

    log, records = logging.getLogger("transformers.modeling_utils"), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    propagate, log.propagate = log.propagate, False
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def text_decoder(model):
    """The module holding the text model's decoder layers (`.layers`), of a causal LM or a wrapper."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for m in (base, getattr(base, "language_model", None), getattr(model, "language_model", None)):
        if m is not None and hasattr(m, "layers"):
            return m
    raise StageError(f"{type(model).__name__}: no decoder stack with `.layers` found (looked at get_decoder() and "
                     "language_model): its hidden states cannot be captured")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        raise StageError(f"the tokenizer in {path} has no chat template: conversations cannot be rendered; "
                         "use an instruct/chat model or add a chat_template to tokenizer_config.json")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
