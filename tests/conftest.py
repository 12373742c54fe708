"""Shared fixtures: one real Dagster instance (SQLite in a temp dir), one local GPU host work directory,
and the data half of the graph materialized once on the embedded SmolLM2 at tiny sizes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.definitions import all_assets
from eagle3_assets.hosts import GpuHost
from in_process_host import InProcessGpuHost

# Tiny but real: 6 training conversations, 3 per shard, short replies.
TINY = {
    "prompts": {"config": {"max_train_conversations": 6}},
    # float32: a batch padded on the left may flip a bf16 near-tie against the same prompt alone, and the
    # tests compare the replies with the target's own greedy continuation
    "synthetic_prompts": {"config": {"count": 0}},  # the shared graph is the human prompts' (test_synthesis has its own)
    "conversations": {"config": {"max_new_tokens": 12, "samples_per_shard": 3, "batch_size": 6, "dtype": "float32"}},
    "hidden_state_shards": {"config": {"dtype": "float32", "batch_tokens": 256}},
    "vocab_mapping": {"config": {"draft_vocab_size": 64}},
}


# The shared graph trains drafters without serving them first: the integration gate, and that it blocks the full
# training, are tested in serving/test_integration_gate.py, which asks for it.
os.environ.setdefault("EAGLE3_INTEGRATION_GATE", "skip")


def pytest_configure(config):
    """The fast tier (`-m "not slow"`) runs torch single-threaded, in this process and in every worker it starts
    (they inherit OMP_NUM_THREADS), unless OMP_NUM_THREADS is set already. The tests' models are tiny: a second
    OpenMP thread buys ~15% on an idle 2-core machine, but on a shared one, where the other core is busy, the
    threads' lock-step waits made a 24-token greedy generation of SmolLM2 take 26 s instead of 2 s (and the
    fast tier 21 minutes). The full suite (CI, the vLLM servers) keeps torch's default."""
    if "not slow" in (config.option.markexpr or "") and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


# The two CPU paths every dtype-dependent test (marker `cpu_dtype`) runs under: the CPU as it is, and a CPU without
# bf16 instructions (EAGLE3_CPU_BF16=0: float32 everywhere), so that an assumption about this machine's CPU fails
# here before it fails on a user's. On a CPU without bf16 the second path is the first again and is skipped.
CPU_PATHS = {"cpu-as-is": None, "cpu-no-bf16": "0"}


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("cpu_dtype"):
        if "cpu_path" not in metafunc.fixturenames:
            metafunc.fixturenames.append("cpu_path")
        metafunc.parametrize("cpu_path", list(CPU_PATHS), indirect=True)


class CpuPath:
    """The path a test runs under: `dtype` is what a stage left on `auto` computes in on this path."""

    def __init__(self, name: str, bf16: bool):
        self.name, self.bf16 = name, bf16
        self.dtype = "bfloat16" if bf16 else "float32"


@pytest.fixture
def cpu_path(request, monkeypatch) -> CpuPath:
    from eagle3_assets.worker import compute_dtype

    force = CPU_PATHS[request.param]
    compute_dtype.cpu.cache_clear()
    if force is not None:
        if compute_dtype.cpu()["cpu_bf16"] is False:
            pytest.skip("this CPU (or EAGLE3_CPU_BF16) already takes the no-bf16 path: the as-is run covers it")
        monkeypatch.setenv(compute_dtype.FORCE_ENV, force)  # the stages this test starts inherit it
        compute_dtype.cpu.cache_clear()
    yield CpuPath(request.param, compute_dtype.cpu()["cpu_bf16"])
    compute_dtype.cpu.cache_clear()  # the next test probes under its own environment


class Graph:
    """Materialize assets of the real graph against one instance and host: by default the stages run in this
    process (in_process_host.py); tests about the host boundary pass a real host."""

    def __init__(self, instance: dg.DagsterInstance, workdir: Path):
        self.instance, self.workdir = instance, workdir
        self.host = InProcessGpuHost(workdir=str(workdir))

    def materialize(self, *names: str, config: dict | None = None, partition: str | None = None,
                    raise_on_error: bool = True, host: GpuHost | None = None):
        ops = {n: (config or {}).get(n, TINY.get(n, {})) for n in names}
        return dg.materialize(all_assets, selection=list(names), instance=self.instance,
                              resources={"gpu_host": host or self.host}, partition_key=partition,
                              run_config={"ops": {k: v for k, v in ops.items() if v}},
                              raise_on_error=raise_on_error)

    def latest(self, name: str, partition: str | None = None) -> dict:
        ev = self.instance.get_latest_materialization_event(dg.AssetKey(name)) if partition is None else \
            next(iter(self.instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(name), asset_partitions=[partition]),
                limit=1).records)).event_log_entry
        return {k: v.value for k, v in ev.asset_materialization.metadata.items()}

    def data_version(self, name: str, partition: str | None = None) -> str:
        recs = self.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(name), asset_partitions=[partition] if partition else None),
            limit=1).records
        return recs[0].event_log_entry.asset_materialization.tags["dagster/data_version"]


# One shard of the built graph, its vocab, and a tiny quick training recipe: what the stage-level tests run on.
SHARD = "hidden_states/shard-00000"
VOCAB = "vocab/vocab_mapping.safetensors"
TINY_TRAIN = {"epochs": 2, "lr": 3e-3, "ttt_steps": 2, "row_tokens": 48, "rows_per_batch": 1, "warmup_ratio": 0.0}


def run_worker(workdir: Path, stage: str, args: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    """A stage as a host runs it: `python -m eagle3_assets.worker STAGE`, its exit status and output (a stage
    that starts an engine server is allowed its minutes)."""
    cmd = [sys.executable, "-m", "eagle3_assets.worker", stage, "--workdir", str(workdir), "--args", json.dumps(args)]
    return subprocess.run(cmd, env={**os.environ, "EAGLE3_NO_BAR": "1"}, capture_output=True, text=True,
                          timeout=timeout)


def run_stage(workdir: Path, stage: str, args: dict) -> subprocess.CompletedProcess:
    """The same as `run_worker`, in this process: the worker's entry point without its signal handling, for
    tests about a stage rather than the process boundary (a worker process spends ~5 s importing torch and
    transformers before it starts)."""
    import torch

    from eagle3_assets.worker import __main__ as entry

    argv = [stage, "--workdir", str(workdir), "--args", json.dumps(args)]
    out, err = io.StringIO(), io.StringIO()
    env, deterministic = os.environ.get("EAGLE3_NO_BAR"), torch.are_deterministic_algorithms_enabled()
    os.environ["EAGLE3_NO_BAR"] = "1"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = entry.run(entry._parse(argv))
    finally:  # what a stage may set for its own process
        if env is None:
            os.environ.pop("EAGLE3_NO_BAR")
        else:
            os.environ["EAGLE3_NO_BAR"] = env
        torch.use_deterministic_algorithms(deterministic)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def speculate_metadata(graph, **args) -> dict:
    """The `speculate` stage (offline acceptance, float32) on the graph's target and newest eagle3_drafter, run in
    this process: its materialization's metadata."""
    done = run_stage(graph.workdir, "speculate", {
        "target": graph.latest("target_model")["path"], "drafter": graph.latest("eagle3_drafter")["path"],
        "dtype": "float32", **args})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]


def train_args(built, out: str, **kw) -> dict:
    return {"target": built.latest("target_model")["path"], "shards": [SHARD], "vocab": VOCAB, "out": out,
            **TINY_TRAIN, **kw}


def last_json(stdout: str) -> dict:
    """The worker's result: the last JSON object on its stdout (engines may log there after it)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON result in the worker's output:\n{stdout[-2000:]}")


def hidden_states(part: dict) -> dict:
    """A shard part's tensors with `aux` and `final` in float32, whichever format wrote them (v2: fp8 with
    per-token scales, dequantized), and each one's fp8 step per element (0 for v1) for the tolerances."""
    import torch

    from eagle3_assets.worker.shards.parts import dequantize_fp8

    out = dict(part)
    for k in ("aux", "final"):
        if f"{k}_scale" in part:
            scale = part[f"{k}_scale"].float()
            out[k] = dequantize_fp8(part[k], scale)
            # e4m3: 3 mantissa bits, so half a step is 1/16 of the value; subnormals step 2^-9 of the scale
            out[f"{k}_step"] = out[k].abs() / 16 + scale.repeat_interleave(part[k].shape[-1] // scale.shape[-1], -1) / 512
        else:
            out[k] = part[k].float()
            out[f"{k}_step"] = torch.zeros_like(out[k])
    return out


def failure_text(result) -> str:
    """Everything a user sees about a failed step: the failure's message and description."""
    parts = []
    for ev in result.all_events:
        if ev.is_step_failure:
            data = ev.step_failure_data
            parts.append(data.error.to_string() if data.error else "")
            if data.user_failure_data is not None:
                parts.append(data.user_failure_data.description or "")
    return "\n".join(parts)


@pytest.fixture(scope="session")
def instance(tmp_path_factory):
    home = tmp_path_factory.mktemp("dagster_home")
    with dg.DagsterInstance.local_temp(str(home)) as inst:
        yield inst


@pytest.fixture(scope="session")
def graph(instance, tmp_path_factory) -> Graph:
    return Graph(instance, tmp_path_factory.mktemp("host_work"))


@pytest.fixture(scope="session")
def built(graph: Graph) -> Graph:
    """target_model -> prompts -> synthetic_prompts (none) -> conversations -> vocab_mapping, then both shard
    partitions."""
    graph.materialize("target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping")
    for key in graph.instance.get_dynamic_partitions("hidden_state_shards"):
        graph.materialize("hidden_state_shards", partition=key)
    return graph


@pytest.fixture
def work(built, tmp_path) -> Path:
    """A host work directory of the test's own, holding a copy of one shard and the vocab: damaging them
    cannot touch the shared fixture."""
    shutil.copytree(built.workdir / SHARD, tmp_path / SHARD)
    (tmp_path / "vocab").mkdir()
    shutil.copy(built.workdir / VOCAB, tmp_path / VOCAB)
    return tmp_path


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (see ssh_server.py), shared by the SSH host's tests."""
    from ssh_server import SshServer

    server = SshServer(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


def served_response(accepted_per_step: list[int], k: int = 3) -> dict:
    """A chat completion as vLLM returns it with --per-request-spec-decode-metrics summary (its fields' names)."""
    hist = [accepted_per_step.count(j) for j in range(k + 1)]
    steps, acc = len(accepted_per_step), sum(accepted_per_step)
    return {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "ok"}}],
            "metrics": {"speculative_decoding": {
                "mean_acceptance_length": 1 + acc / steps, "draft_acceptance_rate": acc / (steps * k),
                "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": acc,
                "num_draft_tokens": steps * k, "num_spec_tokens": k}}}

