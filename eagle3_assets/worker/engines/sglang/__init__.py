"""SGLang: whether the installed version can serve EAGLE-3 for a target, its server command line, its
accept length, its export dialect (eagle_config's layer ids, read per model class) and its refusals, and
hidden-state extraction through its model runner (capture.py, driven by extraction.py). SGLang cannot run on the
machines this project is tested on: this module is held to SGLang's documented flags and outputs
(tests/serving/test_engines.py checks both against the release we support). The engine interface is in
eagle3_assets/worker/engines/__init__.py (`Engine`).

SGLang reports the average accept length cumulatively since the server started (bonus token included, the
same definition as vLLM's acceptance length), so each measurement gets a fresh server."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from ....common import spec_schedule
from ...errors import StageError
from .. import support_probe

NAME = "sglang"
TITLE = "SGLang"
INSTALL = "pip install 'sglang[all]'"
HEALTH = "/health"
SERVER_INFO = "/get_server_info"
SERVER_ENV: dict[str, str] = {}
WARM_UP = False  # SGLang warms itself up; its accept length counts every request it served
# Its /v1/completions choices carry text, finish_reason and matched_stop (the stop token), no token ids: the
# generate stage tokenizes the text again (protocol.py, CompletionResponseChoice).
GENERATION_FIELDS: dict = {}

# Run with the engine's Python. SGLang captures EAGLE-3's aux hidden states through the target class's
# `set_eagle3_layers_to_capture`; a target class without it cannot feed an EAGLE-3 draft.
SUPPORT_PROBE = support_probe("sglang", r'''
try:
    from sglang.srt.models.registry import ModelRegistry
    classes = ModelRegistry.models
    cls = classes.get(arch)
    if cls is None:
        reasons.append(f"it has no model class for the architecture {arch!r}")
    else:
        out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
        if not hasattr(cls, "set_eagle3_layers_to_capture"):
            reasons.append(f"its {cls.__qualname__} has no set_eagle3_layers_to_capture (the aux hidden-state "
                           f"capture EAGLE-3 needs)")
    if "LlamaForCausalLMEagle3" not in classes:
        reasons.append("it has no LlamaForCausalLMEagle3 draft model class")
except Exception as e:
    reasons.append(f"resolving the architecture failed: {type(e).__name__}: {e}")
''')


def serve_refusals(target, info: dict, dtype: str | None, extra: list[str]) -> list[str]:
    return []  # nothing known that its support probe would not refuse already


def text_only(target, info: dict, choice: bool | None) -> bool:
    """SGLang's documented server arguments have no --language-model-only: a wrapper loads whole."""
    if choice:
        raise StageError("language_model_only is a vLLM setting: SGLang's server has no such flag; unset it for "
                         "SGLang (it loads the whole wrapper)")
    return False


def server_command(python: str, target: str, port: int, *, drafter: str | None, k: int, dtype: str,
                   max_model_len: int, seed: int, extra: list[str], language_model_only: bool = False,
                   schedule: list | None = None) -> list[str]:
    """`python -m sglang.launch_server`; with a drafter, chain drafting of k tokens (topk 1, k+1 tokens
    verified), the EAGLE3 algorithm: `EAGLE` with an EAGLE-3 draft loads and silently accepts nothing. With a
    schedule (common/spec_schedule.py): SGLang's adaptive speculation (`--speculative-adaptive`, its config file
    one slot per range with that range's k as the only candidate), num_steps its largest k."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--context-length", str(max_model_len),
            "--random-seed", str(seed), "--enable-metrics",
            # the accept-length totals only grow every decode-log-interval steps (default 40): count every step
            "--decode-log-interval", "1"]
    if drafter:
        k = max(r[2] for r in schedule) if schedule else k
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
        if schedule:
            argv += ["--speculative-adaptive", "--speculative-adaptive-config", adaptive_file(schedule)]
    return argv + list(extra)


def adaptive_file(schedule: list) -> str:
    """The adaptive config as a file SGLang reads at start, named by its content (the same schedule, the same file)."""
    text = json.dumps(spec_schedule.sglang_adaptive_config([tuple(r) for r in schedule]), sort_keys=True)
    path = Path(tempfile.gettempdir()) / f"eagle3-adaptive-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return str(path)


def server_plan(concurrencies: list[int]) -> list[list[int]]:
    """The accept length is cumulative since start: one fresh server per measured concurrency."""
    return [[c] for c in concurrencies]


def measure_start(server) -> None:
    return None  # nothing to subtract: a fresh server per measurement


def acceptance(server, before: None, k: int) -> dict:
    al = accept_length(json.loads(server.get(SERVER_INFO)[1]))
    # a chain of k drafts per verify step (topk 1): accepted/drafted = (length - 1) / k; no per position
    return {"acceptance_length": al, "acceptance_rate": (al - 1) / k if al is not None else None}


def accept_length(server_info: dict) -> float | None:
    """The average accept length from /get_server_info: `internal_states[0].avg_spec_accept_length`
    (older releases put it at the top level)."""
    states = server_info.get("internal_states") or []
    for where in (states[0] if states else {}, server_info):
        value = where.get("avg_spec_accept_length")
        if value is not None:
            return float(value)
    return None


# How SGLang (0.5.14, models/*.py `set_eagle3_layers_to_capture`) reads the export's
# `eagle_config.eagle_aux_hidden_state_layer_ids`: most model classes add 1 to every id (they capture a
# layer's input), so ids there are ours (output of layer i). deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2 and
# K2.5, whose kimi_k25.py hands over to it) and glm4_moe_lite.py add 1 only when the first id is 1, and
# take other lists as capture-before (sglang PR #25454); releases before it added 1 always. So for those
# targets only lists starting at layer 1 mean the same to every release.
FIRST_ID_RULE = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "glm4_moe_lite"})
# And every class captures inside its decoder loop, the input of layer i for i < num_hidden_layers (llama.py,
# deepseek_v2.py `forward`: `if i in self.layers_to_capture`, no capture after the loop): the last layer's
# output (ours N-1) is never captured, and a drafter trained on it would get two aux states of its three.


def layer_problems(ours: list[int], model_type: str, num_layers: int) -> list[str]:
    """Why SGLang would serve a drafter trained on `ours` as another function (empty: it reads them as trained)."""
    problems = []
    if num_layers - 1 in ours:
        problems.append(f"it captures a layer's input inside its decoder loop, so the last layer's output (layer "
                        f"{num_layers - 1}) is never captured")
    if model_type in FIRST_ID_RULE and ours[0] != 1:
        problems.append(f"it reads EAGLE-3 layer ids for {model_type} targets two ways (releases since PR #25454 take "
                        f"a list whose first id is not 1 as capture-before, earlier ones add 1 to every id)")
    return problems


def servable_layers(model_type: str, num_layers: int) -> list[int] | None:
    """Three layers SGLang reads as trained on this target (first, middle and last it can capture), or None."""
    low, high = (1 if model_type in FIRST_ID_RULE else 0), num_layers - 2
    return [low, (low + high) // 2, high] if high - low >= 2 else None


def export_layer_ids(ours: list[int], model_type: str, num_layers: int) -> list[int]:
    problems = layer_problems(ours, model_type, num_layers)
    if problems:
        from ....common.shard_format import default_aux_layers
        from ...errors import StageError

        default, fits = default_aux_layers(num_layers), servable_layers(model_type, num_layers)
        if fits is None:
            advice = (f"No three layers of a {num_layers}-layer {model_type} target are read as trained by SGLang "
                      f"(this target's default aux layers are {default}): export for vllm only (dialects: [vllm])")
        else:
            which = (f"this target's default aux layers {default} are" if not layer_problems(default, model_type,
                     num_layers) else f"e.g. {fits}; this target's default {default} is not")
            advice = (f"Train on aux layers SGLang reads as trained ({which}), or export for vllm only "
                      f"(dialects: [vllm])")
        raise StageError(f"SGLang cannot serve a drafter trained on these layers of this {num_layers}-layer "
                         f"{model_type} target: {'; '.join(problems)}, so aux layers {list(ours)} would be misread. "
                         f"{advice}")
    return list(ours)


def captured_layers(ids: list[int], model_type: str) -> list[int]:
    """The layers (ours) the current SGLang captures for these config ids."""
    if model_type in FIRST_ID_RULE and ids and ids[0] != 1:
        return [int(i) - 1 for i in ids]
    return list(ids)


LAYER_IDS_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"


def export_fields(aux: list[int], model_type: str, num_layers: int) -> dict:
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": export_layer_ids(aux, model_type, num_layers),
                             "use_aux_hidden_state": True}}


def exported_layers(cfg: dict, model_type: str) -> list[int] | None:
    """What SGLang reads: eagle_config's ids, per its model class's rule."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return captured_layers(ids, model_type) if ids else None


def id_rule(ids: list[int], model_type: str) -> tuple[int, str] | None:
    if captured_layers(ids, model_type) != list(ids):
        return -1, f"SGLang's {model_type} rule: a list not starting at 1 is capture-before"
    return None


def check_export(src, cfg: dict) -> None:
    from ...errors import StageError

    layers = int(cfg.get("num_hidden_layers") or 1)
    if layers > 1:
        # sglang/srt/models/llama_eagle3.py: BasicDecoderLayer starts `residual = hidden_states` and drops the
        # residual it is passed, so layers after the first compute another function than the one trained
        raise StageError(f"{src} has {layers} draft layers; SGLang's later EAGLE-3 layers drop the residual "
                         "stream and would compute another function than the one trained. Export it for vllm "
                         "only (dialects: [vllm]), or train with num_layers 1 to serve on SGLang")


TENSOR_PREFIXES = ("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d")


def check_tensors(d, names: list[str]) -> None:
    if any(not k.startswith(TENSOR_PREFIXES) for k in names):
        from ...errors import StageError

        raise StageError(f"{d}: SGLang loads `midlayer.*`-style names only; other names are dropped silently")


# ---------------- hidden-state extraction (capture.py) ----------------

def capture_layers(aux: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """SGLang's `layers_to_capture` for our aux layers (it captures a layer's input: ours + 1; an id of
    num_layers never matches its loop, so the last layer's output comes from the final-state hook), and
    where each of ours lands among [captured..., final]."""
    ids = sorted({i + 1 for i in aux} - {num_layers})
    final = len(ids)
    return ids, [ids.index(i + 1) if i + 1 != num_layers else final for i in aux], final


def extract(target, samples, tmp, aux_layers: list[int], num_layers: int, args, reporter, what: str):
    from .extraction import extract as run  # it finds this module through the registry: no import back

    return run(target, samples, tmp, aux_layers, num_layers, args, reporter, what)


# Whether the installed SGLang has what capture.py drives, from its own code.
EXTRACT_PROBE = support_probe("sglang", r'''
try:
    import dataclasses
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.server_args import ServerArgs, PortArgs
    params = set(inspect.signature(ModelRunner.__init__).parameters)
    need = {"model_config", "mem_fraction_static", "gpu_id", "tp_rank", "tp_size", "moe_ep_rank", "moe_ep_size",
            "pp_rank", "pp_size", "nccl_port", "server_args"}
    if need - params:
        reasons.append(f"its ModelRunner takes no {sorted(need - params)}")
    for m in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs", "forward"):
        if not hasattr(ModelRunner, m):
            reasons.append(f"its ModelRunner has no {m}()")
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    for f in ("disable_radix_cache", "chunked_prefill_size", "disable_cuda_graph", "tp_size", "random_seed"):
        if f not in fields:
            reasons.append(f"its ServerArgs has no {f}")
    if not hasattr(CaptureHiddenMode, "FULL") or not hasattr(Req, "set_extend_input_len"):
        reasons.append("it lacks CaptureHiddenMode.FULL or Req.set_extend_input_len (the capture path of 0.5.14)")
    from sglang.srt.models.registry import ModelRegistry
    cls = ModelRegistry.models.get(arch)
    if cls is None:
        reasons.append(f"it has no model class for the architecture {arch!r}")
    else:
        out["model_class"] = f"{cls.__module__}.{cls.__qualname__}"
        import importlib
        src = inspect.getsource(sys.modules[cls.__module__])
        # the capture lives in the text model's module: the text architecture's, or one this module imports
        names = set(re.findall(r"from (sglang\.srt\.models\.\w+) import", src))
        inner = ModelRegistry.models.get(text_arch)
        if inner is not None:
            names.add(inner.__module__)
        srcs = src + "".join(inspect.getsource(importlib.import_module(n)) for n in sorted(names))
        if "layers_to_capture" not in srcs or "capture_aux_hidden_states" not in srcs:
            reasons.append(f"its {cls.__qualname__} has no aux hidden-state capture (layers_to_capture)")
except Exception as e:
    reasons.append(f"reading its model runner failed: {type(e).__name__}: {e}")
''')
