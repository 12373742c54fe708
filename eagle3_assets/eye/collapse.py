"""A collapse or a drift? Both show as a live window whose drafts are almost never accepted (drift.py suspects a
collapse there); they call for opposite answers. A collapse is an integration fault of the server (the wrong
speculative method, aux layers, draft vocabulary, attention backend: the most common complaint in the engines'
trackers): every kind of prompt fails, the familiar ones too, and retraining cannot fix it (loop/on_drift.py starts
none). A drift is traffic the drafter never learned (a new language): only the new slice fails, and retraining is
what answers it. The report tells them apart by what a collapse is:

- the config the server runs (its own word, vLLM's /server_info in dev mode, else its restart command rendered for
  the drafter it serves, never the template) and the export's, against the trained drafter's;
- the drafter's benchmark prompts sent to the server: accepted as on the benchmark, the integration works;
- the acceptance production served per request, by kind of prompt (the traffic day's served figures): a kind that
  holds up says the same.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request

import dagster as dg
import pyarrow.parquet as pq

from ..assets.paths import PROMPT_SETS
from ..assets.serving import causes, diagnosis
from ..common import spec_counters
from ..common.launch import launch_facts, render
from ..hosts import GpuHost
from ..sources.gateway_logs import TrafficError, served_figures
from . import served
from .live_acceptance import http_get, server_info
from .servers_file import SERVERS_ENV, DriftSettings, Server, load_servers

FACTS = ("served_method", "attention_backend", "served_aux_layers", "trained_aux_layers", "dropped_config_keys",
         "draft_vocab_mapping")
MIN_STEPS = 20  # speculative steps a probe set or a kind of traffic needs to say anything
PROBE_BUDGET_S = 300.0  # the probes stop here: a report must not hold a slow server for long


def _server(name: str) -> Server | None:
    path = os.environ.get(SERVERS_ENV)
    try:
        return next((s for s in load_servers(path).servers if s.name == name), None) if path else None
    except ValueError:
        return None


def served_launch(server: Server | None, drafter: str | None) -> dict:
    """How the server serves the drafter: its own word (vLLM's /server_info, dev mode), else its restart command
    rendered for the drafter it serves (with the launch file it names); never the template, whose placeholders say
    nothing of what runs. {} when neither is there."""
    if server is None:
        return {}
    spec = ((server_info(server) or {}).get("vllm_config") or {}).get("speculative_config")
    if isinstance(spec, dict) and spec:
        return {"served_method": spec.get("method"), "served_k": spec.get("num_speculative_tokens"),
                "served_from": "the server's own /server_info"}
    if server.restart and drafter:
        try:
            argv = render(list(server.restart), drafter, server.engine)
        except FileNotFoundError as e:
            return {"served_from": f"unknown: {e}"}
        facts = {k: v for k, v in launch_facts(argv).items() if v is not None}
        return {**facts, "served_from": f"its restart command, rendered for {drafter}"}
    return {}


def evidence(instance: dg.DagsterInstance, server: str, ckpt: str | None, drafter: str | None = None) -> dict:
    """What is known of how the server serves the drafter: its launch (served_launch) and the newest serving_benchmark
    of the checkpoint (the aux layers the engine captured against those trained, config keys dropped in the export,
    the draft vocabulary mapping)."""
    facts = served_launch(_server(server), drafter)
    for rec in instance.fetch_materializations(served.BENCHMARK, limit=served.SCAN).records if ckpt else []:
        m = served.meta(rec)
        if m.get("checkpoint") == ckpt:
            facts.update({k: m[k] for k in FACTS if m.get(k) is not None and k not in facts})
            facts["benchmark_acceptance_length"] = m.get("acceptance_length")
            break
    return facts


def benchmark_prompts(host: GpuHost, prompt_set: str | None, n: int) -> list[list[dict]]:
    """The first n prompts of the drafter's benchmark set (the eval split by default), each its messages up to the
    first user turn, read from the host."""
    rel = PROMPT_SETS.get(prompt_set or "eval", PROMPT_SETS["eval"])
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "prompts.parquet")
        host.get_file(rel, local)
        rows = pq.read_table(local, columns=["messages"]).to_pylist()
    out = []
    for r in rows:
        msgs = list(r["messages"] or [])
        first = next((i for i, m in enumerate(msgs) if m.get("role") == "user"), None)
        if first is not None:
            out.append([{"role": m["role"], "content": m["content"]} for m in msgs[: first + 1]])
        if len(out) >= n:
            break
    return out


def probe(server: Server, prompts: list[list[dict]], max_tokens: int, budget_s: float = PROBE_BUDGET_S) -> dict:
    """The prompts sent to the server one at a time (greedy, as benchmarked): the acceptance it served them with,
    from each response's per-request metrics (vLLM's --per-request-spec-decode-metrics), else from its counters
    around the probes (other requests served meanwhile count too)."""
    timeout = max(server.timeout_s, 120.0)
    model = json.loads(http_get(f"{server.url}/v1/models", server.timeout_s))["data"][0]["id"]
    before = spec_counters.vllm_counters(http_get(f"{server.url}/metrics", server.timeout_s).decode())
    steps = accepted = answered = 0
    per_request = True
    t0 = time.monotonic()
    for messages in prompts:
        if time.monotonic() - t0 > budget_s:
            break
        body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"{server.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (the team's own server)
            resp = json.loads(r.read())
        answered += 1
        try:
            got = served_figures({"response": resp}, "a probe's response")
        except TrafficError:
            got = None
        if got is None:
            per_request = False
        else:
            steps, accepted = steps + got["served_steps"], accepted + got["served_accepted"]
    if not per_request:
        after = spec_counters.vllm_counters(http_get(f"{server.url}/metrics", server.timeout_s).decode())
        w = spec_counters.window(before, after)
        steps, accepted = int(w["num_drafts"]), int(w["num_accepted_tokens"])
    return {"prompts": answered, "steps": steps, "acceptance_length": round(1 + accepted / steps, 4) if steps else None,
            "read_from": "each response's per-request metrics" if per_request else
            "the server's counters around the probes (other requests served meanwhile count too)"}


def probes(instance: dg.DagsterInstance, host: GpuHost, server: str, drafter: str | None,
           settings: DriftSettings, log) -> dict:
    """The benchmark's prompts sent to the server, or why none were: {"acceptance_length", ...} or {"skipped"}."""
    entry = _server(server)
    if not settings.probe_prompts:
        return {"skipped": "drift.probe_prompts is 0"}
    if entry is None or entry.engine != "vllm":
        return {"skipped": "probes read vLLM's figures; the server is not a vLLM server of the servers file"}
    info = served.describe(instance, entry, drafter)
    try:
        prompts = benchmark_prompts(host, info["benchmark_prompt_set"], settings.probe_prompts)
    except (OSError, ValueError, KeyError) as e:
        return {"skipped": f"the benchmark's prompts could not be read from the host: {type(e).__name__}: {e}"}
    log(f"{server}: sending {len(prompts)} prompts of the drafter's benchmark, to tell a collapse from a drift")
    try:
        return probe(entry, prompts, settings.probe_tokens)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return {"skipped": f"the server did not answer the probes: {type(e).__name__}: {e}"}


def _share(al: float | None, bench: float | None) -> float | None:
    """Drafts accepted per step, as a share of the benchmark's."""
    return None if al is None or not bench or bench <= 1 else (al - 1) / (bench - 1)


def verdict(facts: dict, probed: dict, groups: list[dict], bench: float | None,
            settings: DriftSettings) -> tuple[bool, str]:
    """(collapse, why): a fault in the config the server runs, else the probes, else the kinds of traffic served.
    With none of them to say, it stays a collapse (not retrained), unconfirmed."""
    if found := causes(facts):
        return True, f"the config the server runs differs from the trained drafter's ({len(found)} cause found)"
    share = _share(probed.get("acceptance_length"), bench)
    if probed.get("steps", 0) >= MIN_STEPS and share is not None:
        said = (f"{probed['prompts']} prompts of its benchmark sent to the server were accepted at an acceptance "
                f"length of {probed['acceptance_length']:.3f} against {bench:.3f} benchmarked ({share:.0%} of the "
                f"drafts per step; {probed['steps']} steps, read from {probed['read_from']})")
        return (True, f"{said}: familiar prompts fail too") if share <= settings.collapse_ratio else \
            (False, f"{said}: the server's integration works, the traffic moved away from what the drafter learned")
    holding = [g for g in groups if g["by"] == "kind" and (g.get("steps") or 0) >= MIN_STEPS
               and (s := _share(g["acceptance_length"], bench)) is not None and s > settings.collapse_ratio]
    if holding:
        g = max(holding, key=lambda g: g["acceptance_length"])
        return False, (f"the requests of kind `{g['value']}` were served at an acceptance length of "
                       f"{g['acceptance_length']:.3f} ({g['steps']} steps): the server's integration works, only some "
                       "of the traffic fails")
    missing = probed.get("skipped") or (f"too few probe steps ({probed.get('steps', 0)})" if probed else "no probes")
    return True, ("unconfirmed: no fault found in the config the server runs, and nothing to tell it from a drift "
                  f"({missing}; no kind of the traffic served with enough steps): held a collapse, not retrained; "
                  "send the server a few of the prompts it was benchmarked on to tell")


def line(server: str, num_drafts: int | None, window_s: int | None, live: float | None, facts: dict,
         why: str) -> str:
    known = "; ".join(f"{k} {v}" for k, v in facts.items()) or "none in this instance (no restart command in the " \
        "servers file, no serving_benchmark of this checkpoint)"
    return (f"**Collapse, not drift**: {server} served {num_drafts} speculative steps in the last {window_s} s at an "
            f"acceptance length of {live:.3f}: the drafter's tokens are almost never accepted, and {why}. That is an "
            f"integration fault of the server, not a change in its traffic: retraining cannot fix it and none is "
            f"started. Evidence: {known}. {diagnosis(facts)}")


def drift_line(server: str, num_drafts: int | None, window_s: int | None, live: float | None, why: str) -> str:
    return (f"**Drift, not collapse**: {server} served {num_drafts} speculative steps in the last {window_s} s at an "
            f"acceptance length of {live:.3f}, almost nothing accepted, but {why}: a drift to traffic the drafter "
            "never saw, which retraining answers.")
