"""The `vllm` backend of stage `extract`: the target served by vLLM on the host (tensor and data parallel as
configured) with the `extract_hidden_states` method, and our KV connector (engines/vllm_connector.py)
writing the shard's parts. This module is the connector's client: it sends each sample as a `max_tokens=1`
completion, asks each data-parallel engine to finish its parts, and checks every sample against what was
asked before anything is published: its rows equal its token count, its ids equal the tokenized
conversation, its loss mask is ours (sent as spans, from our template code)."""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .engines import vllm
from .engines.server import EngineServer, free_port
from .engines.vllm_connector import parts_file
from .errors import StageError
from .shard_writer import Sample

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding eagle3_assets/


def is_wrapper(target: Path) -> bool:
    cfg = json.loads((target / "config.json").read_text())
    return "text_config" in cfg or "vision_config" in cfg


def loss_spans(mask: list[int]) -> list[list[int]]:
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


def _post(port: int, body: dict, headers: dict | None = None, timeout_s: float = 600.0) -> dict:
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


def _request(s: Sample, dir_name: str) -> dict:
    return {"model": "target", "prompt": s.input_ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"eagle3": {"dir": dir_name, "row": s.row, "id": s.id,
                                              "loss_spans": loss_spans(s.loss_mask)}}}


def validate_dump(samples: list[Sample], index: list[dict], read_ids, problems: list[str]) -> None:
    """Every sample exactly once, with as many rows as tokens and the ids asked for; a StageError naming
    the first bad samples and the likely cause otherwise. `read_ids(row)`: the ids stored for an index row."""
    by_row: dict[int, list[dict]] = {}
    for r in index:
        by_row.setdefault(int(r["row"]), []).append(r)
    bad = list(problems)
    for s in samples:
        got = by_row.get(s.row, [])
        if len(got) != 1:
            bad.append(f"row {s.row} ({s.id}): written {len(got)} times")
            continue
        r = got[0]
        if r["length"] != len(s.input_ids):
            bad.append(f"row {s.row} ({s.id}): {r['length']} hidden-state rows for {len(s.input_ids)} tokens")
        elif read_ids(r) != s.input_ids:
            bad.append(f"row {s.row} ({s.id}): the engine's token ids differ from the tokenized conversation")
        elif r["loss_tokens"] != sum(s.loss_mask):
            bad.append(f"row {s.row} ({s.id}): {r['loss_tokens']} loss tokens, expected {sum(s.loss_mask)}")
    extra = sorted(set(by_row) - {s.row for s in samples})
    if extra:
        bad.append(f"rows {extra[:5]} were written but not asked for")
    if bad:
        short = any("hidden-state rows for" in b for b in bad)
        cause = (" A dump shorter than its tokens comes from prefix caching or chunked prefill in some vLLM "
                 "releases: keep both off for extraction (extract_args), or upgrade vLLM." if short else "")
        raise StageError(f"the engine's dump fails validation for {len(bad)} sample(s): " + "; ".join(bad[:5])
                         + (" ..." if len(bad) > 5 else "") + "." + cause + " Nothing was published.")


def extract(target: Path, samples: list[Sample], tmp: Path, aux_layers: list[int], num_layers: int, args: dict,
            reporter, what: str) -> tuple[list[dict], list[dict], dict]:
    """Run the samples through the engine into `tmp`; returns (part files, index rows, engine info)."""
    from .serve_bench import check_support

    python = args.get("engine_python") or sys.executable
    info = check_support(vllm, python, target, probe=vllm.EXTRACT_PROBE, purpose="extract hidden states")
    ids, aux_cols, final_col = vllm.capture_layers(aux_layers, num_layers)
    tp, dp = int(args.get("tensor_parallel_size", 1)), int(args.get("data_parallel_size", 1))
    max_len = max(len(s.input_ids) for s in samples) + 1
    port = free_port()
    argv = vllm.extract_command(
        python, str(target), port, layer_ids=ids, root=str(tmp.parent.resolve()), aux_columns=aux_cols,
        final_column=final_col, part_bytes=int(args.get("part_bytes", 1 << 30)),
        io_threads=int(args.get("io_threads", 4)), dtype=args.get("dtype", "bfloat16"),
        max_model_len=int(args.get("max_model_len") or max_len), tensor_parallel_size=tp, data_parallel_size=dp,
        seed=int(args.get("seed", 0)), extra=list(args.get("extra_args") or []))
    if is_wrapper(target) and info.get("language_model_only") and "--language-model-only" not in argv:
        argv.append("--language-model-only")  # a multimodal wrapper (Kimi-K2.5): text in, no vision tower loaded
    env = {str(k): str(v) for k, v in (args.get("env") or {}).items()}
    # the engine imports our connector by module path: the worker's own code, wherever it was uploaded
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    reporter.log(f"vllm {info['version']} extracts for {info['architecture']} ({info.get('model_class', '?')}); "
                 f"capture ids {ids} (vLLM numbering) for aux layers {aux_layers} + final, TP={tp} DP={dp}")
    log = tmp.parent / ".logs" / f"vllm-{tmp.name.removeprefix('.tmp-')}.log"
    t_start = time.monotonic()
    with EngineServer("vllm (extraction)", argv, port, log, env=env, health=vllm.HEALTH) as server:
        ready = server.wait_ready(float(args.get("ready_timeout_s", 1800)), reporter)
        reporter.log(f"vllm ready for extraction after {ready:.0f} s")
        t0 = time.monotonic()

        def one(s: Sample) -> None:
            try:
                _post(port, _request(s, tmp.name))
            except (OSError, http.client.HTTPException, ValueError, StageError) as e:
                why = server.died(wait_s=10)
                raise StageError(f"extraction request for row {s.row} ({s.id}) failed: {e}" + (f"\n{why}" if why else ""))
            progress.update(len(s.input_ids))

        total = sum(len(s.input_ids) for s in samples)
        with reporter.progress(what, total, unit="tokens") as progress, \
                ThreadPoolExecutor(max_workers=int(args.get("concurrency", 32))) as pool:
            for f in [pool.submit(one, s) for s in samples]:
                f.result()
        nonce = uuid.uuid4().hex
        for rank in range(dp):  # one flush per data-parallel engine, routed to it
            # a few tokens, not one: a one-token prompt runs the decode path, which some backends lack (CPU MLA)
            _post(port, {"model": "target", "prompt": samples[0].input_ids[:8], "max_tokens": 1,
                         "kv_transfer_params": {"eagle3": {"dir": tmp.name, "flush": nonce}}},
                  headers={"X-data-parallel-rank": str(rank)} if dp > 1 else None)
        results = []
        deadline = time.monotonic() + float(args.get("flush_timeout_s", 600))
        for rank in range(dp):
            path = tmp / parts_file(rank)
            while True:
                try:
                    got = json.loads(path.read_text())
                    if got.get("nonce") == nonce:
                        break
                except (OSError, ValueError):
                    pass
                if (why := server.died()) is not None:
                    raise StageError(f"vllm died before finishing the shard's parts: {why}")
                if time.monotonic() > deadline:
                    raise StageError(f"vllm engine {rank} did not finish the shard's parts within flush_timeout_s; "
                                     f"its log: {log}")
                time.sleep(0.2)
            if got.get("error"):
                raise StageError(f"vllm engine {rank} failed writing the shard's parts: {got['error']}")
            results.append(got)
            path.unlink()
        wall = time.monotonic() - t0
    files = [f for r in results for f in r["files"]]
    index = [row for r in results for row in r["index"]]
    problems = [p for r in results for p in r["problems"]]
    from safetensors import safe_open

    handles = {}

    def read_ids(row: dict) -> list[int]:
        h = handles.get(row["part"]) or handles.setdefault(row["part"], safe_open(str(tmp / row["part"]), "pt"))
        return h.get_slice("input_ids")[row["offset"]: row["offset"] + row["length"]].tolist()

    validate_dump(samples, index, read_ids, problems)
    return files, index, {"engine": "vllm", "engine_version": info["version"], "engine_model_class": info.get("model_class"),
                          "capture_ids": ids, "tensor_parallel_size": tp, "data_parallel_size": dp,
                          "engine_ready_s": round(ready, 1), "engine_wall_s": round(wall, 2),
                          "stage_wall_s": round(time.monotonic() - t_start, 2)}
