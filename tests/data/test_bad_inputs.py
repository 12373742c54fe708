"""Bad input fails the run with a message that names the problem, and nothing half-written looks complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import failure_text, last_json


def _prompts_fail(graph, sources, **extra):
    cfg = {"prompts": {"config": {"sources": sources, "include_humaneval": False, **extra}}}
    res = graph.materialize("prompts", config=cfg, raise_on_error=False)
    assert not res.success
    return failure_text(res)


def test_missing_prompts_file(graph, tmp_path):
    missing = tmp_path / "nope.jsonl"
    msg = _prompts_fail(graph, [str(missing)])
    assert str(missing) in msg and "not found" in msg


def test_malformed_jsonl_line_is_named_with_its_number(graph, tmp_path):
    f = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    f.write_text(f"{good}\n{good.replace('hi', 'hello')}\n{{\"messages\": [\n")
    msg = _prompts_fail(graph, [str(f)])
    assert f"{f}, line 3" in msg and "malformed JSON" in msg


def test_conversation_without_user_turn(graph, tmp_path):
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hello"}]},
                             {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "Hi"}]}]))
    msg = _prompts_fail(graph, [str(f)])
    assert f"{f}, record 1" in msg and "no user turn" in msg
    # the same file is usable when the user asks to skip bad records
    ok = graph.materialize("prompts", config={"prompts": {"config": {
        "sources": [str(f)], "include_humaneval": False, "on_bad_record": "skip", "eval_fraction": 0.0}}})
    assert ok.success
    graph.materialize("prompts")  # restore the fixture's prompts


def test_unknown_target_path(graph, tmp_path):
    missing = tmp_path / "models" / "llama-9000"
    res = graph.materialize("target_model", config={"target_model": {"config": {"path": str(missing)}}},
                            raise_on_error=False)
    assert not res.success
    msg = failure_text(res)
    assert str(missing) in msg and "does not exist" in msg


def test_target_that_is_not_a_causal_lm(graph, tmp_path):
    from transformers import BertConfig, BertModel

    d = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(d)
    res = graph.materialize("target_model", config={"target_model": {"config": {"path": str(d)}}},
                            raise_on_error=False)
    assert not res.success
    msg = failure_text(res)
    assert "not a causal language model" in msg and "BertModel" in msg


def test_killed_extraction_leaves_no_shard_that_looks_complete(built, tmp_path):
    """The worker is killed -9 in the middle of a shard: the shard is absent (only a temp dir without a
    manifest remains); the next run of that shard cleans up and completes."""
    # 8 samples of 128 tokens, one part each: the kill lands after the second part, with six still to come
    n, length = 8, 128
    rows = [{"id": f"s{i}", "input_ids": [(7 * i + j) % 49000 + 10 for j in range(length)],
             "loss_mask": [j % 2 for j in range(length)]} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "conv.parquet")
    target = built.latest("target_model")["path"]
    args = {"target": target, "conversations": "conv.parquet", "out_dir": "hs", "shard": 0, "samples_per_shard": n,
            "batch_tokens": length, "part_bytes": 1, "dtype": "float32"}
    cmd = [sys.executable, "-m", "eagle3_assets.worker", "extract", "--workdir", str(tmp_path), "--args", json.dumps(args)]
    env = {**os.environ, "EAGLE3_NO_BAR": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hs = tmp_path / "hs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(hs.glob(".tmp-shard-00000-*/part-0001.safetensors")):
        assert proc.poll() is None, "the worker finished before it could be interrupted"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (hs / "shard-00000").exists()
    (tmp,) = list(hs.glob(".tmp-shard-00000-*"))
    assert not (tmp / "manifest.json").exists()

    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["tokens"] == n * length
    manifest = json.loads((hs / "shard-00000" / "manifest.json").read_text())
    assert manifest["samples"] == n and manifest["tokens"] == n * length
    assert [p.name for p in hs.iterdir()] == ["shard-00000"]


def test_engine_parallelism_the_target_or_host_cannot_take_is_refused_before_the_engine_starts(built, tmp_path):
    """TP x DP beyond the host's GPUs, or a TP that does not divide the target's heads: vLLM would load for
    minutes, then fail. The stage refuses at once, naming the settings, the heads and the GPUs."""
    from eagle3_assets.worker.engines.dump import check_parallel
    from eagle3_assets.worker.errors import StageError

    key = built.instance.get_dynamic_partitions("hidden_state_shards")[0]
    res = built.materialize("hidden_state_shards", partition=key, raise_on_error=False, config={
        "hidden_state_shards": {"config": {"backend": "vllm", "tensor_parallel_size": 4}}})
    assert not res.success
    msg = failure_text(res)  # the embedded SmolLM2 has 9 heads, 3 KV heads
    assert "tensor_parallel_size 4 does not divide the target's 9 attention heads" in msg and "[1, 3, 9]" in msg, msg
    assert "died while starting" not in msg

    def refused(cfg: dict, tp: int, dp: int, gpus: int) -> str:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        try:
            check_parallel(tmp_path, tp, dp, gpus, "vLLM")
        except StageError as e:
            return str(e)
        return ""

    llama = {"num_attention_heads": 32, "num_key_value_heads": 8}
    assert "= 8 GPUs, and this host has 4" in refused(llama, 4, 2, 4)
    assert not refused(llama, 4, 2, 8) and not refused(llama, 8, 1, 0)  # a CPU host: the engine places its ranks
    assert "8 KV heads" in refused({"num_attention_heads": 48, "num_key_value_heads": 8}, 3, 1, 8)
    kimi = {"text_config": {"num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512}}
    assert not refused(kimi, 8, 1, 8) and "host has 8" in refused(kimi, 8, 2, 8)
