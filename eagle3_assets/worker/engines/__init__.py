"""The serving engines, one module or package each (`vllm/`, `sglang/`: server, acceptance reading, export
dialect, hidden-state extraction and capture), the interface every one implements (`Engine`), which the
stages call (serve_bench, generate, export, extract, engine_check, checkpoint) without naming an engine, and
`get`, which finds one by name. A third engine is one more module or package here implementing `Engine`.
What they share: the server process (`server.py`), the load generator (`load.py`), the extraction dump both
backends write (`dump.py`). Their names, for the control plane too: eagle3_assets/common/engines.py."""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from ...common.engines import DEFAULT, NAMES

__all__ = ["DEFAULT", "INTERFACE", "NAMES", "Engine", "get", "reading", "support_probe"]


class Engine(Protocol):
    """What an engine module defines (module-level names and functions). Layer ids are "ours" (the output of
    decoder layer i, the final state apart) unless said otherwise; each engine translates to its own numbering."""

    NAME: str  # the module's name: the partition key, the export dialect, the stages' `engine`/`backend` value
    TITLE: str  # as written in messages ("vLLM")
    INSTALL: str  # how to install it, for the "not installed" error
    HEALTH: str  # the server's health route
    SERVER_ENV: dict[str, str]  # server environment defaults (the stage's `env` setting overrides them)
    SUPPORT_PROBE: str  # run with the engine's Python (see `support_probe`): can it serve EAGLE-3 for the target?
    EXTRACT_PROBE: str  # ... can it extract hidden states for the target?
    WARM_UP: bool  # send one request before measuring (compilation/warm-up out of the figures)
    LAYER_IDS_FIELD: str  # the config field (dotted) its export dialect names the aux layers in
    GENERATION_FIELDS: dict  # added to a /v1/completions request that generates training data (token ids back)

    # ---- serving (serve_bench; generate's server backend: drafter=None) ----
    def server_command(self, python: str, target: str, port: int, *, drafter: str | None, k: int, dtype: str,
                       max_model_len: int, seed: int, extra: list[str], language_model_only: bool = False) -> list[str]:
        """The server's argv (`--port` among it): the target alone, or with the EAGLE-3 `drafter` drafting k."""

    def serve_refusals(self, target, info: dict, dtype: str | None, extra: list[str]) -> list[str]:
        """Why the server this engine would start with an EAGLE-3 drafter for `target` (`dtype`, the stage's
        extra_args) would fail after starting, from the facts of its support probe (`info`) and the target's
        config.json; each reason says what to do. server.serve_preflight asks it before any server starts."""

    def text_only(self, target, info: dict, choice: bool | None) -> bool:
        """Whether to serve a multimodal wrapper's text model alone (the stages' `language_model_only`; `info`:
        the support probe's answer); the same answer for every stage that starts the engine."""

    def server_plan(self, concurrencies: list[int]) -> list[list[int]]:
        """The concurrencies the speculative servers measure, one list per fresh server."""

    def measure_start(self, server) -> Any:
        """What `acceptance` needs from before a measurement (an `EngineServer`: `.get(route)`)."""

    def acceptance(self, server, before: Any, k: int) -> dict:
        """Acceptance over the measurement: acceptance_length (bonus token included), acceptance_rate, and
        acceptance_per_pos / num_drafts... where the engine counts them."""

    # ---- export dialect (export, checkpoint, serve_bench's layer wiring) ----
    def export_fields(self, aux: list[int], model_type: str, num_layers: int) -> dict:
        """The config fields that make the engine capture `aux` (non-default layers) of a target of `num_layers`;
        StageError if it would not capture them as trained (an ambiguous reading, a layer it never captures)."""

    def exported_layers(self, cfg: dict, model_type: str) -> list[int] | None:
        """The layers (ours) the engine captures for this drafter config; None when it names none (the
        engine's defaults: shard_format.engine_default_aux_layers)."""

    def id_rule(self, ids: list[int], model_type: str) -> tuple[int, str] | None:
        """(offset to ours, description) when the engine reads the ids in LAYER_IDS_FIELD other than as its
        convention says, for this target's model type; else None."""

    def check_export(self, src, cfg: dict) -> None:
        """Refuse (StageError) a drafter this engine would serve as another function than the one trained."""

    def check_tensors(self, d, names: list[str]) -> None:
        """Refuse (StageError) an export holding tensors the engine would not load."""

    # ---- hidden-state extraction (extract) ----
    def capture_layers(self, aux: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
        """(ids in the engine's numbering, the column of each of ours among what it returns, the final's)."""

    def extract(self, target, samples, tmp, aux_layers: list[int], num_layers: int, args: dict, reporter,
                what: str) -> tuple[list[dict], list[dict], dict]:
        """The shard's samples through the engine into `tmp`: (part files, index rows, engine info)."""


INTERFACE = tuple(sorted({*Engine.__annotations__, *(n for n in vars(Engine) if not n.startswith("_"))}))


def get(name: str):
    """The engine module `name`; a ValueError naming the known engines, or what the module lacks."""
    if name not in NAMES:
        raise ValueError(f"unknown engine {name!r}: the engines are {', '.join(NAMES)} (eagle3_assets/worker/engines/)")
    module = importlib.import_module(f"{__name__}.{name}")
    missing = [n for n in INTERFACE if not hasattr(module, n)]
    if missing or module.NAME != name:
        raise ValueError(f"engine module {module.__name__} does not implement the engine interface "
                         f"(eagle3_assets/worker/engines/__init__.py: Engine): "
                         + (f"it lacks {missing}" if missing else f"its NAME is {module.NAME!r}"))
    return module


def reading(field: str) -> list:
    """The engines whose export dialect names the aux layers in `field` (dotted)."""
    return [e for e in map(get, NAMES) if e.LAYER_IDS_FIELD == field]


# The common frame of the support probes: a script run with the engine's Python (argv: architecture,
# model_type, its text model's architecture for a wrapped target, the text model's shapes as JSON:
# `target_shapes`, and the server's extra_args as JSON when a preflight passes them) that imports the engine, runs the
# engine's own checks (which append to `reasons`) and prints one JSON line.
_PROBE_HEAD = r'''
import inspect, json, re, sys
arch, model_type = sys.argv[1], sys.argv[2]
text_arch = sys.argv[3] if len(sys.argv) > 3 else arch
shapes = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # the text model's shapes an engine may limit
launch = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []  # the server's extra_args, for the facts they change
out = {"engine": "%(name)s", "architecture": arch, "model_type": model_type}
try:
    import %(name)s as engine
except Exception as e:
    out.update(installed=False, error=f"{type(e).__name__}: {e}")
    print(json.dumps(out)); sys.exit(0)
out.update(installed=True, version=getattr(engine, "__version__", "unknown"))
reasons = []
'''
_PROBE_TAIL = r'''
out["supported"] = not reasons
out["reasons"] = reasons
print(json.dumps(out))
'''


def support_probe(name: str, checks: str) -> str:
    return _PROBE_HEAD % {"name": name} + checks + _PROBE_TAIL


def target_shapes(cfg: dict) -> dict:
    """The shapes of a target's text model that an engine's kernels may limit (a support probe's 4th argument):
    an MLA model's latent width, kv_lora_rank + qk_rope_head_dim, and the head width of the EAGLE-3 draft layer
    trained for it (its v_head_dim, as training/drafter.py's DraftConfig.from_target gives it), whose attention
    the engine picks apart from the target's."""
    tc = cfg.get("text_config") or cfg
    if tc.get("kv_lora_rank"):
        rope = int(tc.get("qk_rope_head_dim") or 0)
        shapes = {"mla_latent": int(tc["kv_lora_rank"]) + rope, "kv_lora_rank": int(tc["kv_lora_rank"]),
                  "qk_rope_head_dim": rope}
        if tc.get("v_head_dim") or (tc.get("hidden_size") and tc.get("num_attention_heads")):
            shapes["draft_head_dim"] = int(tc.get("v_head_dim") or tc["hidden_size"] // tc["num_attention_heads"])
        return shapes
    return {}
