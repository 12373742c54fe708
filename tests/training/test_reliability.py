"""The reliability issue's cases: stale resumes, damaged shards, NaN training, paths out of the work
directory, half-replaced prompts, an unreadable benchmark history, and settings that make no sense. Each bad
input fails clearly (or is handled) and leaves nothing that looks like a result."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SHARD, VOCAB, failure_text, last_json, run_stage, train_args


def _written(root: Path) -> list[Path]:
    """Everything under root but the workers' output locks (.eagle3/locks: bookkeeping, not output)."""
    return [p for p in root.rglob("*") if ".eagle3" not in p.relative_to(root).parts]


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model" / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _extract(built, work: Path, aux_layers: list[int] | None) -> None:
    done = run_stage(work, "extract", {
        "target": built.latest("target_model")["path"],
        "conversations": str(built.workdir / "conversations/conversations.parquet"), "out_dir": "hidden_states",
        "shard": 0, "samples_per_shard": 3, "dtype": "float32", "batch_tokens": 256,
        "aux_layers": aux_layers})
    assert done.returncode == 0, done.stderr[-3000:]


# ---- 1: a rerun with the same run_name resumes only the run it belongs to --------------------------------

def test_rerun_after_reextracting_with_other_aux_layers_retrains(built, work):
    """The story: train, re-extract the shard with other aux layers, rerun with the same name. It must train
    again (not 'resume from step N of N' and republish the old weights), and end where a fresh run ends."""
    first = run_stage(work, "train", train_args(built, "drafter/same"))
    assert first.returncode == 0, first.stderr[-3000:]
    old = _weights(work / "drafter/same")
    old_ids = json.loads((work / "drafter/same/model/config.json").read_text())["eagle3_assets"]["aux_layer_ids"]

    _extract(built, work, [2, 10, 20])
    rerun = run_stage(work, "train", train_args(built, "drafter/same"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"shard {SHARD} (content) changed since it was written; training afresh" in rerun.stderr
    assert "resuming from" not in rerun.stderr
    res = last_json(rerun.stdout)
    assert res["steps"] > 0
    new = _weights(work / "drafter/same")
    assert not torch.equal(new["fc.weight"], old["fc.weight"])
    cfg = json.loads((work / "drafter/same/model/config.json").read_text())
    assert cfg["eagle3_assets"]["aux_layer_ids"] == [2, 10, 20] != old_ids

    fresh = run_stage(work, "train", train_args(built, "drafter/fresh"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert _same(_weights(work / "drafter/fresh"), new)

    # unchanged inputs: it resumes at the last step, trains nothing, publishes the same weights
    again = run_stage(work, "train", train_args(built, "drafter/same"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from step-{res['steps']:07d} (step {res['steps']} of {res['steps']})" in again.stderr
    assert _same(_weights(work / "drafter/same"), new)
    assert last_json(again.stdout)["data_version"] == res["data_version"]


@pytest.mark.slow  # five training runs and a vocab run (~25 s of CPU); the aux-layer rerun above keeps the
# stale-resume case in the fast tier
def test_rerun_after_the_vocab_or_a_setting_changed_retrains(built, work):
    assert run_stage(work, "train", train_args(built, "drafter/v")).returncode == 0
    old = _weights(work / "drafter/v")
    done = run_stage(work, "vocab", {"target": built.latest("target_model")["path"], "out": VOCAB, "draft_vocab_size": 48,
                                   "conversations": str(built.workdir / "conversations/conversations.parquet")})
    assert done.returncode == 0, done.stderr[-2000:]
    rerun = run_stage(work, "train", train_args(built, "drafter/v"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "vocab (content) changed" in rerun.stderr
    new = _weights(work / "drafter/v")
    assert new["d2t"].shape == (48,) and old["d2t"].shape == (64,)
    fresh = run_stage(work, "train", train_args(built, "drafter/v-fresh"))
    assert fresh.returncode == 0 and _same(_weights(work / "drafter/v-fresh"), new)

    # a hyperparameter: named with both values
    more = run_stage(work, "train", train_args(built, "drafter/v", lr=1e-3))
    assert more.returncode == 0, more.stderr[-3000:]
    assert "hyperparameters (lr 0.003 -> 0.001)" in more.stderr and "resuming from" not in more.stderr
    assert not _same(_weights(work / "drafter/v"), new)


# ---- 5: damaged shards are refused before a step; a non-finite loss stops the run -------------------------

def _manifest(work: Path) -> dict:
    return json.loads((work / SHARD / "manifest.json").read_text())


def _flip_byte(work: Path) -> Path:
    part = work / SHARD / _manifest(work)["files"][0]["name"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01  # in the middle of the tensors: the header still parses, sizes still match
    part.write_bytes(bytes(data))
    return part


def _rewrite_index(work: Path) -> Path:
    index = work / SHARD / "index.parquet"
    rows = pq.read_table(index).to_pylist()
    rows[0]["length"] -= 1  # a plausible index, no longer the one extracted
    pq.write_table(pa.Table.from_pylist(rows), index)
    return index


def _inf_in_aux(work: Path) -> Path:
    """An inf in the aux states, with the manifest's size and sha256 updated: only the finiteness check sees it."""
    from eagle3_assets.worker.files import sha256_file

    m = _manifest(work)
    part = work / SHARD / m["files"][0]["name"]
    t = load_file(str(part))
    if "aux_scale" in t:  # format v2 (the default): fp8 has no inf (it saturates at 448); the scale can be
        t["aux_scale"][5, 1] = float("inf")
    else:
        t["aux"][5, 7] = float("inf")
    save_file(t, str(part))
    m["files"][0].update(bytes=part.stat().st_size, sha256=sha256_file(part))
    (work / SHARD / "manifest.json").write_text(json.dumps(m))
    return part


@pytest.mark.parametrize("damage,expect", [
    (_flip_byte, "differs from"), (_rewrite_index, "its sha256 differs"), (_inf_in_aux, "tensor 'aux' holds NaN or inf"),
], ids=["flipped-byte", "rewritten-index", "inf-in-aux"])
def test_damaged_shard_is_refused_naming_the_file(built, work, damage, expect):
    bad = damage(work)
    done = run_stage(work, "train", train_args(built, "drafter/damaged"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert str(bad) in done.stderr and expect in done.stderr
    assert "rerun hidden_state_shards partition 00000" in done.stderr
    assert not (work / "drafter/damaged/model").exists()


def test_a_non_finite_loss_stops_training_naming_the_step(built, work):
    """A learning rate that blows the weights up: the run stops at the first non-finite loss, writes no drafter."""
    done = run_stage(work, "train", train_args(built, "drafter/nan", lr=1e30, max_grad_norm=1e30))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the training loss is not finite (NaN or inf) at step" in done.stderr
    step = int(done.stderr.split("not finite (NaN or inf) at step ")[1].split()[0])
    assert step >= 2  # the first step's loss is finite: the weights were sound before it
    assert "nothing was written as the drafter" in done.stderr
    assert not (work / "drafter/nan/model").exists()


# ---- 6: run_name cannot leave the host work directory -------------------------------------------------------

def test_run_name_with_a_path_is_refused_by_the_config(built):
    outside = (built.workdir / "drafter" / "../../x").resolve()
    res = built.materialize("eagle3_drafter", config={"eagle3_drafter": {"config": {"run_name": "../../x"}}},
                            raise_on_error=False)
    assert not res.success
    msg = failure_text(res)
    assert "run_name" in msg and "is not a plain name" in msg
    assert not outside.exists()


@pytest.mark.parametrize("args,expect", [
    ({"out": "drafter/../../x"}, "contains '..'"),
    ({"out": "drafter/x", "run_name": "../../x"}, "run_name: '../../x' is not a plain name"),
])
def test_worker_refuses_an_output_outside_its_directory(built, tmp_path, args, expect):
    work = tmp_path / "a" / "b" / "work"
    work.mkdir(parents=True)
    done = run_stage(work, "train", {**train_args(built, "unused"), **args})
    assert done.returncode == 2 and expect in done.stderr, done.stderr[-2000:]
    assert sorted(p.name for p in _written(tmp_path)) == ["a", "b", "work"]  # nothing written anywhere


# ---- 9: a failed prompts run leaves the previous prompt files as they were ---------------------------------

def _bad_sources(d: Path) -> list[tuple[Path, str]]:
    good = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    jsonl = d / "chats.jsonl"
    jsonl.write_text(f"{good}\n{good.replace('2 + 2', '3 + 3')}\n{{\"messages\": [\n")
    gz = d / "chats.jsonl.gz"
    gz.write_bytes(gzip.compress(((good + "\n") * 200).encode())[:-40])  # truncated download
    latin = d / "latin1.jsonl"
    latin.write_bytes((good + "\n").encode() + '{"prompt": "café"}\n'.encode("latin-1"))
    parquet = d / "broken.parquet"
    parquet.write_bytes(b"PAR1 this is not a parquet file")
    surrogate = d / "surrogate.jsonl"
    surrogate.write_text(f"{good}\n" + '{"prompt": "half an emoji: \\ud83d"}\n')
    return [(jsonl, f"{jsonl}, line 3: malformed JSON"), (gz, f"prompt source '{gz}' cannot be read"),
            (surrogate, f"{surrogate}, line 2: text that is not valid Unicode"),
            (latin, f"{latin}, line 2: not UTF-8 text"), (parquet, f"prompt source '{parquet}' cannot be read")]


def test_failed_prompts_run_leaves_the_previous_files_untouched(graph, tmp_path):
    assert graph.materialize("prompts").success  # the fixture's prompts, as `built` makes them
    files = {p: p.read_bytes() for p in (graph.workdir / "prompts").glob("*.parquet")}
    # prompts' own files, and synthetic_prompts' beside them (same folder, untouched too)
    assert {p.name for p in files} >= {"train.parquet", "eval.parquet", "eval_humaneval.parquet"}
    for source, expect in _bad_sources(tmp_path):
        res = graph.materialize("prompts", config={"prompts": {"config": {"sources": ["bundled", str(source)]}}},
                                raise_on_error=False)
        assert not res.success
        assert expect in failure_text(res), failure_text(res)
        assert {p: p.read_bytes() for p in (graph.workdir / "prompts").glob("*.parquet")} == files, source
    assert not [p for p in (graph.workdir / "prompts").iterdir() if p.name.startswith(".")]  # no temp files left


# ---- 10: an unreadable benchmark history is set aside before any server starts ------------------------------

def test_unreadable_history_is_set_aside_before_any_server_starts(built, tmp_path):
    history = tmp_path / "benchmarks" / "serving_history.parquet"
    history.parent.mkdir()
    garbage = b"PAR1" + os.urandom(300)  # a torn write of another tool, say
    history.write_bytes(garbage)
    # engine_python that does not exist: the stage stops at the engine preflight, the first thing after the
    # history (so no server can have started)
    done = run_stage(tmp_path, "serve_bench", {
        "engine": "vllm", "engine_python": str(tmp_path / "no-python"), "target": built.latest("target_model")["path"],
        "drafter": str(tmp_path / "drafter"), "prompts": str(built.workdir / "prompts/eval.parquet"),
        "out_dir": "benchmarks/vllm/x", "history": "benchmarks/serving_history.parquet"})
    assert done.returncode == 2 and "does not exist on the host" in done.stderr, done.stderr[-2000:]
    (kept,) = history.parent.glob("serving_history.parquet.corrupt-*")
    assert kept.read_bytes() == garbage and not history.exists()
    assert f"benchmark history {history} cannot be read" in done.stderr and str(kept) in done.stderr

    # the append the stage makes after its measurements: a new, readable history of this result
    from eagle3_assets.worker.report import Reporter
    from eagle3_assets.worker.serving.bench import append_history

    moved: list[str] = []
    append_history(history, [{"engine": "vllm", "concurrency": 1, "acceptance_length": 1.5}], Reporter(), moved)
    append_history(history, [{"engine": "vllm", "concurrency": 8, "acceptance_length": 1.4}], Reporter(), moved)
    assert [r["concurrency"] for r in pq.read_table(history).to_pylist()] == [1, 8] and not moved
    # a column whose type changed: the old file is kept aside, the new row is not lost
    append_history(history, [{"engine": "vllm", "concurrency": "one", "acceptance_length": 1.3}], Reporter(), moved)
    assert [r["concurrency"] for r in pq.read_table(history).to_pylist()] == ["one"]
    assert len(moved) == 1 and [r["concurrency"] for r in pq.read_table(moved[0]).to_pylist()] == [1, 8]


# ---- 11: counts that make no sense are refused before anything runs ---------------------------------------

@pytest.mark.parametrize("asset,field,value", [
    ("eagle3_drafter", "epochs", 0), ("eagle3_drafter", "lr", -1e-4), ("prompts", "max_user_turns", 0),
    ("prompts", "max_train_conversations", -5), ("conversations", "max_new_tokens", 0),
    ("conversations", "samples_per_shard", -1), ("vocab_mapping", "draft_vocab_size", 0),
    ("offline_acceptance", "num_speculative_tokens", 0), ("offline_acceptance", "limit", 0),
])
def test_non_positive_counts_are_refused_by_the_config(graph, asset, field, value):
    """Dagster's config schema carries types only, so pydantic's bounds refuse the value as the step starts,
    before the asset's code (and any work on the host) runs."""
    res = graph.materialize(asset, config={asset: {"config": {field: value}}}, raise_on_error=False)
    assert not res.success
    msg = failure_text(res)
    assert "validation error for" in msg and f"\n{field}\n" in msg and "greater than" in msg, msg
    assert not [e for e in res.all_events if e.event_type_value == "ASSET_MATERIALIZATION"]


def test_worker_refuses_settings_out_of_range_before_any_work(built, tmp_path):
    done = run_stage(tmp_path, "train", train_args(built, "drafter/zero", epochs=0, ttt_steps=-1, warmup_ratio=1.0))
    assert done.returncode == 2
    for named in ("epochs: Input should be greater than 0, got 0", "ttt_steps: Input should be greater than 0, got -1",
                  "warmup_ratio: Input should be less than 1, got 1.0"):
        assert named in done.stderr, done.stderr
    assert not _written(tmp_path)


def test_a_stop_that_lands_inside_a_finalizer_still_stops_the_worker():
    """SIGTERM handled while the main thread runs a `__del__` (Python ignores exceptions there): the worker
    must still stop and die of the signal, not finish its stage as if never cancelled."""
    code = textwrap.dedent("""
        import gc, os, signal, sys, time
        import eagle3_assets.worker.__main__ as w
        w.install_stop_handlers()
        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(100_000))  # the handler runs here, inside the finalizer
        try:
            Finalized()
            gc.collect()
            time.sleep(10)
            print("finished the stage regardless")
        except w._Stopped as stop:
            signal.signal(stop.sig, signal.SIG_DFL)
            os.kill(os.getpid(), stop.sig)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "finished the stage regardless" not in proc.stdout
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)
