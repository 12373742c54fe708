"""The `sglang` backend of stage `extract`: SGLang's model runner in its own environment, tensor and data
parallel (capture.py), writing the shard's parts as vLLM's connector does; this module
starts it, shows its progress, and checks the dump exactly as for vLLM before anything is published.
SGLang cannot run on the machines this project is tested on: this path is held to SGLang 0.5.14's code
(tests/serving/test_engines.py), not run."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from ... import engines
from ...errors import StageError
from ...shards.writer import Sample
from ..dump import collect, engine_run, loss_spans, stored_ids, validate_dump
from ..server import EngineServer

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ....stages.extract import ExtractArgs


def extract(target: Path, samples: list[Sample], tmp: Path, aux_layers: list[int], num_layers: int, args: ExtractArgs,
            reporter, what: str) -> tuple[list[dict], list[dict], dict]:
    sglang = engines.get("sglang")
    run = engine_run(sglang, target, aux_layers, num_layers, args)
    python, info, ids, tp, dp = run.python, run.info, run.capture_ids, run.tp, run.dp
    nonce = uuid.uuid4().hex
    spec = {"target": str(target), "out_dir": str(tmp.resolve()), "nonce": nonce, "capture_ids": ids,
            "aux_columns": run.aux_columns, "final_column": run.final_column, "tensor_parallel_size": tp,
            "data_parallel_size": dp,
            "dtype": args.dtype, "batch_tokens": int(args.batch_tokens),
            "part_bytes": int(args.part_bytes), "io_threads": int(args.io_threads),
            "storage": args.storage,
            "seed": int(args.seed), "trust_remote_code": "--trust-remote-code" in (args.extra_args or []),
            "samples": [{"row": s.row, "id": s.id, "input_ids": s.input_ids, "loss_spans": loss_spans(s.loss_mask)}
                        for s in samples]}
    spec_path = tmp / "sglang-spec.json"
    spec_path.write_text(json.dumps(spec))
    reporter.log(f"sglang {info['version']} extracts for {info['architecture']} ({info.get('model_class', '?')}); "
                 f"layers_to_capture {ids} (SGLang numbering) for aux layers {aux_layers} + final, TP={tp} DP={dp}")
    argv = [python, "-m", "eagle3_assets.worker.engines.sglang.capture", str(spec_path)]
    total = sum(len(s.input_ids) for s in samples)
    t0 = time.monotonic()
    with EngineServer("sglang (extraction)", argv, 0, tmp.parent / ".logs" / f"sglang-{tmp.name}.log",
                      env=run.env) as capture, reporter.progress(what, total, unit="tokens") as progress:
        seen = 0
        while capture.proc.poll() is None:
            done = sum(int((tmp / f"progress-d{r}").read_text() or 0) for r in range(dp)
                       if (tmp / f"progress-d{r}").exists())
            if done > seen:
                progress.update(done - seen)
                seen = done
            time.sleep(1.0)
        if capture.proc.returncode != 0:
            raise StageError(f"SGLang's capture failed: {capture.died()}")
        files, index, problems = collect(tmp, dp, nonce, capture.died, 60.0, "sglang")
        wall = time.monotonic() - t0
    for f in [spec_path, *tmp.glob("progress-d*")]:
        f.unlink()
    validate_dump(samples, index, stored_ids(tmp), problems)
    return files, index, {"engine": "sglang", "engine_version": info["version"],
                          "engine_model_class": info.get("model_class"), "capture_ids": ids,
                          "tensor_parallel_size": tp, "data_parallel_size": dp, "engine_wall_s": round(wall, 2)}
