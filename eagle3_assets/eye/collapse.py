"""A collapse: a served drafter whose tokens are almost never accepted (acceptance length near 1). Always an
integration fault of the server (the wrong speculative method, aux layers, draft vocabulary, attention backend:
the most common complaint in the engines' trackers), never drift, so it is an error, its report says "collapse,
not drift" with the evidence at hand, and no retraining answers it (loop/on_drift.py)."""

from __future__ import annotations

import os

import dagster as dg

from ..assets.serving import causes, diagnosis  # noqa: F401 (causes: what the report counts)
from ..common.launch import launch_facts
from . import served
from .servers_file import SERVERS_ENV, load_servers

FACTS = ("served_method", "attention_backend", "served_aux_layers", "trained_aux_layers", "dropped_config_keys",
         "draft_vocab_mapping")


def evidence(instance: dg.DagsterInstance, server: str, ckpt: str | None) -> dict:
    """What is known of how the server serves the drafter: its launch (the servers file's restart command: the
    speculative method, the attention backend) and the newest serving_benchmark of the checkpoint (the aux layers
    the engine captured against those trained, config keys dropped in the export, the draft vocabulary mapping)."""
    facts: dict = {}
    path = os.environ.get(SERVERS_ENV)
    try:
        entry = next((s for s in load_servers(path).servers if s.name == server), None) if path else None
    except ValueError:
        entry = None
    if entry is not None and entry.restart:
        facts.update({k: v for k, v in launch_facts(list(entry.restart)).items() if v is not None})
    for rec in instance.fetch_materializations(served.BENCHMARK, limit=served.SCAN).records if ckpt else []:
        m = served.meta(rec)
        if m.get("checkpoint") == ckpt:
            facts.update({k: m[k] for k in FACTS if m.get(k) is not None and k not in facts})
            facts["benchmark_acceptance_length"] = m.get("acceptance_length")
            break
    return facts


def line(server: str, num_drafts: int | None, window_s: int | None, live: float | None, facts: dict) -> str:
    known = "; ".join(f"{k} {v}" for k, v in facts.items()) or "none in this instance (no restart command in the " \
        "servers file, no serving_benchmark of this checkpoint)"
    return (f"**Collapse, not drift**: {server} served {num_drafts} speculative steps in the last {window_s} s at an "
            f"acceptance length of {live:.3f}: the drafter's tokens are almost never accepted. That is an integration "
            f"fault of the server, not a change in its traffic: retraining cannot fix it and none is started. "
            f"Evidence: {known}. {diagnosis(facts)}")
