"""Prompts the target writes itself (`synthetic_prompts`, stage `synthesize`): filtered, kept clear of every
human prompt, resumable to the same set, and named in the lineage of a result that rests on them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from conftest import Graph, run_stage, run_worker
from eagle3_assets import lineage, stages
from eagle3_assets.worker.data import synthesize

SMALL = {"chunk_size": 4, "batch_size": 4, "max_new_tokens": 48, "dtype": "float32"}
SMALLER = {**SMALL, "count": 3, "chunk_size": 2, "batch_size": 2}  # two chunks or more


def _args(built, out: Path, **kw) -> dict:
    return {"target": built.latest("target_model")["path"], "train": str(built.workdir / "prompts/train.parquet"),
            "held_out": [str(built.workdir / "prompts/eval.parquet")], "out": str(out), **SMALL, **kw}


def _meta(done) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]


def _prompts(path: Path) -> list[tuple[str, str]]:
    return [(r["id"], r["messages"][0]["content"]) for r in pq.read_table(path).to_pylist()]


def test_count_zero_writes_none_and_loads_no_model(built, tmp_path):
    meta = _meta(run_stage(built.workdir, "synthesize", _args(built, tmp_path / "s.parquet", count=0)))
    assert meta["prompts"] == 0 and _prompts(tmp_path / "s.parquet") == []
    assert "dtype" not in meta  # nothing computed
    assert built.latest("synthetic_prompts")["prompts"] == 0  # the shared graph's conversations are the humans'


def test_a_held_out_prompt_planted_among_the_candidates_is_dropped(built, tmp_path):
    """Candidates sit on disk chunk by chunk (what a rerun reuses): planted there, a held-out prompt, a near copy
    of one (case, punctuation), a training prompt with one word changed, the assistant's voice in the user's
    turn and a repeat of an earlier candidate are dropped as such; the rest pass."""
    held = [r["messages"][0]["content"] for r in pq.read_table(built.workdir / "prompts/eval.parquet").to_pylist()]
    train = [r["messages"][0]["content"] for r in pq.read_table(built.workdir / "prompts/train.parquet").to_pylist()]
    words = next(t for t in train if len(t.split()) >= 10).split()
    words[len(words) // 2] = "zebra"
    fresh = ["Which three rivers meet at the city of Pittsburgh, and why did that matter for its trade?",
             "Suggest a weekly plan for learning to juggle five balls, starting from three."]
    planted = [held[0], held[1].upper().rstrip(".?!") + " !", " ".join(words),
               "Sure! Here is a short poem about the sea for you.", fresh[0], fresh[1], fresh[0]]
    out = tmp_path / "s.parquet"
    args = _args(built, out, count=2)
    parts = out.with_name(out.name + ".parts")
    parts.mkdir()
    fp = synthesize._fingerprint(stages.validate("synthesize", args), Path(args["target"]), Path(args["train"]))
    (parts / "fingerprint.json").write_text(json.dumps(fp, sort_keys=True))
    synthesize.write_chunk(parts / "chunk-00000.jsonl",
                           [{"text": t, "ids": list(range(12)), "capped": False, "opening": ""} for t in planted])
    meta = _meta(run_stage(built.workdir, "synthesize", args))
    assert [t for _, t in _prompts(out)] == fresh
    assert meta["dropped_near_held_out_prompt"] == 2 and meta["dropped_near_training_prompt"] == 1
    assert meta["dropped_assistant_voice"] == 1
    assert meta["chunks_reused"] == 1 and meta["candidates"] == 6  # it stops once it has its two


@pytest.fixture(scope="module")
def kept_candidates(built, tmp_path_factory):
    """One synthesis of SMALLER (two chunks or more): the arguments, the set it published and its chunks on disk."""
    out = tmp_path_factory.mktemp("kept") / "s.parquet"
    args = _args(built, out, **SMALLER)
    _meta(run_stage(built.workdir, "synthesize", args))
    return args, _prompts(out), out.with_name(out.name + ".parts")


def _again(built, kept_candidates, tmp_path, damage):
    """The kept chunks copied beside a new output, damaged by `damage(parts)`, then the stage run again."""
    args, published, kept = kept_candidates
    out = tmp_path / "s.parquet"
    parts = out.with_name(out.name + ".parts")
    shutil.copytree(kept, parts)
    damage(parts)
    done = run_stage(built.workdir, "synthesize", {**args, "out": str(out)})
    return done, _meta(done), _prompts(out), published, parts


def _cut(path: Path, size: int) -> None:
    """What a crash or a full disk leaves: the file's first `size` bytes."""
    path.write_bytes(path.read_bytes()[:size])


def _last_kept(kept_candidates) -> tuple[str, int]:
    """The chunk holding the last prompt of the set, and that prompt's line in it (ids are syn-<chunk>-<line>)."""
    _, chunk, line = kept_candidates[1][-1][0].split("-")
    return f"chunk-{chunk}.jsonl", int(line)


@pytest.mark.parametrize("how, why", [("at_line_end", "cut short"), ("within_line", "ends within a line (torn)"),
                                      ("altered", "does not match the hash on its last line")])
def test_a_chunk_cut_short_torn_or_altered_is_generated_again(built, kept_candidates, tmp_path, how, why):
    """A chunk damaged at the line of a prompt the set holds: cut before that line (whole lines still), within
    it, or its words changed. Reused, it would publish another set without a word, or crash naming no file; it
    is generated again, the log naming it and why."""
    name, line = _last_kept(kept_candidates)

    def damage(parts):
        lines = (parts / name).read_bytes().splitlines(keepends=True)
        head, it = b"".join(lines[:line]), lines[line]
        changed = {"at_line_end": b"", "within_line": it[: len(it) // 2],
                   "altered": it.replace(b'"text": "', b'"text": "Oh ', 1)}[how]
        (parts / name).write_bytes(head + changed + (b"".join(lines[line + 1:]) if how == "altered" else b""))

    done, meta, prompts, published, parts = _again(built, kept_candidates, tmp_path, damage)
    assert prompts == published
    assert f"candidate chunk {parts / name} " in done.stderr and why in done.stderr, done.stderr[-2000:]
    assert "JSONDecodeError" not in done.stderr and meta["chunks_regenerated"] == 1


def test_a_torn_fingerprint_is_named_and_the_candidates_made_afresh(built, kept_candidates, tmp_path):
    """Without the settings the chunks were made with, none of them can be trusted: all are generated again."""
    def damage(parts):
        _cut(parts / "fingerprint.json", (parts / "fingerprint.json").stat().st_size // 2)

    done, meta, prompts, published, parts = _again(built, kept_candidates, tmp_path, damage)
    assert done.returncode == 0 and prompts == published
    assert f"{parts / 'fingerprint.json'} is torn or not JSON" in done.stderr, done.stderr[-2000:]
    assert "JSONDecodeError" not in done.stderr and meta["chunks_reused"] == 0
    assert json.loads((parts / "fingerprint.json").read_text()) == json.loads(
        (kept_candidates[2] / "fingerprint.json").read_text())  # written whole again


@pytest.mark.slow  # three worker processes, one killed mid-run: 42 s on 2 cores
def test_a_resumed_synthesis_writes_the_same_set(built, tmp_path):
    """A worker killed after its first chunk, then run again: the chunks on disk are reused and the set is the
    one an uninterrupted run writes. (Every run a worker process: the same threads, the same sampled tokens.)"""
    whole = tmp_path / "whole.parquet"
    meta = _meta(run_worker(built.workdir, "synthesize", _args(built, whole, **SMALLER)))
    assert meta["prompts"] == 3 and meta["candidates"] >= 3
    cut = tmp_path / "cut.parquet"
    cmd = [sys.executable, "-m", "eagle3_assets.worker", "synthesize", "--workdir", str(built.workdir), "--args",
           json.dumps(_args(built, cut, **SMALLER))]
    proc = subprocess.Popen(cmd, env={**os.environ, "EAGLE3_NO_BAR": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    first = cut.with_name(cut.name + ".parts") / "chunk-00000.jsonl"
    deadline = time.monotonic() + 300
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # its own process group, started above
    proc.wait()
    assert first.exists() and not cut.exists()
    again = _meta(run_worker(built.workdir, "synthesize", _args(built, cut, **SMALLER)))
    assert again["chunks_reused"] >= 1
    assert _prompts(cut) == _prompts(whole)


@pytest.fixture(scope="module")
def synthetic_graph(tmp_path_factory):
    """Its own graph (the session's stays human-only): 4 synthetic prompts through to an exported drafter."""
    cfg = {"prompts": {"config": {"max_train_conversations": 4}},
           "synthetic_prompts": {"config": {"count": 4, **SMALL}},
           "conversations": {"config": {"max_new_tokens": 12, "samples_per_shard": 16, "dtype": "float32"}},
           "hidden_state_shards": {"config": {"dtype": "float32", "batch_tokens": 256}},
           "vocab_mapping": {"config": {"draft_vocab_size": 64}},
           "eagle3_drafter": {"config": {"epochs": 1, "ttt_steps": 2, "row_tokens": 64, "rows_per_batch": 1}}}
    with dg.DagsterInstance.local_temp(str(tmp_path_factory.mktemp("syn_dagster_home"))) as instance:
        g = Graph(instance, tmp_path_factory.mktemp("syn_host_work"))
        g.materialize("target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping", config=cfg)
        g.materialize("hidden_state_shards", partition="00000", config=cfg)
        g.materialize("eagle3_drafter", "drafter_export", config=cfg)
        yield g


def test_conversations_count_the_synthetic_prompts_replies(synthetic_graph):
    meta = synthetic_graph.latest("conversations")
    assert meta["conversations_by_source"] == {"bundled": 4, "synthetic": 4}
    assert meta["loss_tokens_by_source"]["synthetic"] > 0
    syn = synthetic_graph.latest("synthetic_prompts")
    assert syn["prompts"] == 4 and syn["settings"]["count"] == 4 and len(syn["examples_kept"]) == 4


def test_lineage_from_a_benchmark_reaches_the_synthetic_prompts_settings(synthetic_graph):
    """A benchmark result of the drafter trained on them names the synthetic prompts' version and the settings
    that wrote them."""
    inst = synthetic_graph.instance
    export = inst.fetch_materializations(dg.AssetKey("drafter_export"), limit=1).records[0]
    inst.report_runless_asset_event(dg.AssetMaterialization(
        "serving_benchmark", partition="vllm", metadata={"engine": "vllm", "acceptance_length": 1.5},
        tags={"dagster/input_event_pointer/drafter_export": str(export.storage_id)}))
    row = lineage.history(inst)[-1]
    assert row["synthetic_prompts_version"] == synthetic_graph.data_version("synthetic_prompts")
    settings = json.loads(row["synthetic_prompts_config"])
    assert settings["count"] == 4 and settings["max_new_tokens"] == SMALL["max_new_tokens"]
