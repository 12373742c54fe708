"""The `vllm` backend of stage `extract`: the target served by vLLM on the host (tensor and data parallel as
configured) with the `extract_hidden_states` method, and our KV connector (connector.py beside it)
writing the shard's parts. This module is the connector's client: it sends each sample as a `max_tokens=1`
completion, asks each data-parallel engine to finish its parts, and checks every sample against what was
asked before anything is published: its rows equal its token count, its ids equal the tokenized
conversation, its loss mask is ours (sent as spans, from our template code)."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ... import engines
from ...errors import StageError
from ...shards.writer import Sample
from ..dump import collect, engine_run, loss_spans, stored_ids, validate_dump
from ..server import EngineServer, free_port

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ....stages.extract import ExtractArgs


def post_completion(port: int, body: dict, headers: dict | None = None, timeout_s: float = 600.0) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise StageError(f"HTTP {resp.status}: {data[:500].decode(errors='replace')}")
        return json.loads(data)
    finally:
        conn.close()


def sample_request(s: Sample, dir_name: str) -> dict:
    return {"model": "target", "prompt": s.input_ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"eagle3": {"dir": dir_name, "row": s.row, "id": s.id,
                                              "loss_spans": loss_spans(s.loss_mask)}}}


def extract(target: Path, samples: list[Sample], tmp: Path, aux_layers: list[int], num_layers: int, args: ExtractArgs,
            reporter, what: str) -> tuple[list[dict], list[dict], dict]:
    """Run the samples through the engine into `tmp`; returns (part files, index rows, engine info)."""
    vllm = engines.get("vllm")
    run = engine_run(vllm, target, aux_layers, num_layers, args)
    python, info, ids, tp, dp = run.python, run.info, run.capture_ids, run.tp, run.dp
    max_len = max(len(s.input_ids) for s in samples) + 1
    port = free_port()
    argv = vllm.extract_command(
        python, str(target), port, layer_ids=ids, root=str(tmp.parent.resolve()), aux_columns=run.aux_columns,
        final_column=run.final_column, part_bytes=int(args.part_bytes),
        io_threads=int(args.io_threads), dtype=args.dtype,
        storage=args.storage,
        max_model_len=int(args.max_model_len or max_len), tensor_parallel_size=tp, data_parallel_size=dp,
        seed=int(args.seed), extra=list(args.extra_args or []))
    text_only = vllm.text_only(target, info, args.language_model_only)
    if text_only and "--language-model-only" not in argv:
        argv.append("--language-model-only")  # a multimodal wrapper (Kimi-K2.5): text in, no vision tower loaded
    env = {**vllm.EXTRACT_ENV, **run.env}  # the engine imports our connector by module path (PYTHONPATH)
    reporter.log(f"vllm {info['version']} extracts for {info['architecture']} ({info.get('model_class', '?')}); "
                 f"capture ids {ids} (vLLM numbering) for aux layers {aux_layers} + final, TP={tp} DP={dp}")
    log = tmp.parent / ".logs" / f"vllm-{tmp.name.removeprefix('.tmp-')}.log"
    t_start = time.monotonic()
    with EngineServer("vllm (extraction)", argv, port, log, env=env, health=vllm.HEALTH) as server:
        ready = server.wait_ready(float(args.ready_timeout_s), reporter)
        reporter.log(f"vllm ready for extraction after {ready:.0f} s")
        t0 = time.monotonic()

        def one(s: Sample) -> None:
            try:
                post_completion(port, sample_request(s, tmp.name))
            except (OSError, http.client.HTTPException, ValueError, StageError) as e:
                why = server.died(wait_s=10)
                raise StageError(f"extraction request for row {s.row} ({s.id}) failed: {e}"
                                 + (f"\n{why}" if why else "")) from e
            progress.update(len(s.input_ids))

        total = sum(len(s.input_ids) for s in samples)
        with reporter.progress(what, total, unit="tokens") as progress, \
                ThreadPoolExecutor(max_workers=int(args.concurrency)) as pool:
            for f in [pool.submit(one, s) for s in samples]:
                f.result()
        nonce = uuid.uuid4().hex
        for rank in range(dp):  # one flush per data-parallel engine, routed to it
            # a few tokens, not one: a one-token prompt runs the decode path, which some backends lack (CPU MLA)
            post_completion(port, {"model": "target", "prompt": samples[0].input_ids[:8], "max_tokens": 1,
                         "kv_transfer_params": {"eagle3": {"dir": tmp.name, "flush": nonce}}},
                  headers={"X-data-parallel-rank": str(rank)} if dp > 1 else None)
        files, index, problems = collect(tmp, dp, nonce, server.died, float(args.flush_timeout_s),
                                         "vllm")
        wall = time.monotonic() - t0
    validate_dump(samples, index, stored_ids(tmp), problems)
    return files, index, {"engine": "vllm", "engine_version": info["version"], "engine_model_class": info.get("model_class"),
                          "capture_ids": ids, "tensor_parallel_size": tp, "data_parallel_size": dp,
                          "language_model_only": text_only,
                          "engine_ready_s": round(ready, 1), "engine_wall_s": round(wall, 2),
                          "stage_wall_s": round(time.monotonic() - t_start, 2)}
