"""The data half of the graph, materialized through Dagster on the real SmolLM2 target (tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import hidden_states, run_stage
from eagle3_assets.common.shard_format import default_aux_layers
from eagle3_assets.worker.files import hash_files
from tiny_targets import save_tiny_llama


@pytest.fixture(scope="module")
def target(built):
    path = built.latest("target_model")["path"]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_target_model_metadata_describes_the_weights(built, target):
    meta = built.latest("target_model")
    path, model, _ = target
    cfg = model.config
    assert meta["architecture"] == "LlamaForCausalLM" and meta["model_type"] == cfg.model_type == "llama"
    assert (meta["num_layers"], meta["hidden_size"], meta["vocab_size"]) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    assert meta["parameters"] == sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    # data version = content hash of the weight files
    assert built.data_version("target_model") == hash_files(sorted(Path(path).glob("*.safetensors")))[:32]


def test_target_model_data_version_is_stable_across_rematerialization(built):
    before = built.data_version("target_model")
    built.materialize("target_model")
    assert built.data_version("target_model") == before


def test_a_second_instance_copies_the_machines_converted_target(built, tmp_path):
    """The GGUF is converted once per machine: another instance's target_model copies that conversion, the
    same weights (data version), in seconds."""
    import subprocess
    import sys

    from conftest import last_json
    from eagle3_assets.worker.target.prepare import _cache_dir

    cached = _cache_dir()
    assert (cached / "config.json").exists()  # kept by the session's first conversion
    done = subprocess.run([sys.executable, "-m", "eagle3_assets.worker", "prepare_target", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "copying the embedded target" in done.stderr and "converting" not in done.stderr
    assert last_json(done.stdout)["weights_sha256"] == built.data_version("target_model")


def test_prompts_split_is_disjoint_and_humaneval_is_available(built):
    meta = built.latest("prompts")
    train = pq.read_table(built.workdir / "prompts/train.parquet").to_pylist()
    evals = pq.read_table(built.workdir / "prompts/eval.parquet").to_pylist()
    human = pq.read_table(built.workdir / "prompts/eval_humaneval.parquet").to_pylist()
    assert len(train) == meta["train_conversations"] == 6
    assert len(evals) == meta["eval_conversations"] >= 1
    assert len(human) == 164 and {r["source"] for r in human} == {"humaneval"}
    user = lambda rows: {json.dumps([m for m in r["messages"] if m["role"] == "user"]) for r in rows}  # noqa: E731
    assert not user(train) & user(evals)
    assert {r["source"] for r in train} == {"bundled"}


def test_conversations_are_the_targets_own_greedy_replies(built, target):
    _, model, tok = target
    rows = pq.read_table(built.workdir / "conversations/conversations.parquet").to_pylist()
    assert len(rows) == 6
    for r in rows:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles[::2] == ["user"] * (len(roles) // 2) and roles[1::2] == ["assistant"] * (len(roles) // 2)
    # The last reply of the first conversation is the target's greedy continuation of exactly the prompt it was
    # fed, kept as produced: nothing stripped, its end-of-turn token only if it emitted one.
    first = rows[0]["messages"]
    i = max(k for k, m in enumerate(first) if m["role"] == "assistant")
    prompt = tok(tok.apply_chat_template(first[:i], tokenize=False, add_generation_prompt=True),
                 return_tensors="pt", add_special_tokens=False)["input_ids"]
    new = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()  # float32, as the fixture
    eos = model.generation_config.eos_token_id
    own = new[: new.index(eos) + 1] if eos in new else new
    assert first[i]["content"] == tok.decode(own, skip_special_tokens=True)
    assert rows[0]["input_ids"] == prompt[0].tolist() + own and rows[0]["loss_mask"][-len(own):] == [1] * len(own)
    meta = built.latest("conversations")
    assert meta["generated_tokens"] == sum(r["generated_tokens"] for r in rows) > 0
    assert meta["tokens_per_s"] > 0 and meta["sampling"]["temperature"] == 0.0
    assert meta["sampling"]["max_new_tokens"] == 12 and meta["backend"] == "hf"


def test_sampled_replies_are_recorded_per_kind(built, tmp_path):
    """responses_per_prompt 3: each prompt's greedy reply (the fixture's own) and two sampled ones, each its own
    conversation, counted per kind; the same seeds give the same replies."""
    args = {"target": built.latest("target_model")["path"], "prompts": str(built.workdir / "prompts/train.parquet"),
            "limit": 2, "max_new_tokens": 12, "dtype": "float32", "batch_size": 6, "responses_per_prompt": 3,
            "sample_temperature": 1.0}
    done = run_stage(built.workdir, "generate", {**args, "out": str(tmp_path / "a.parquet")})
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
    rows = pq.read_table(tmp_path / "a.parquet").to_pylist()
    fixture = {r["id"]: r for r in pq.read_table(built.workdir / "conversations/conversations.parquet").to_pylist()}
    prompt_ids = [r["id"] for r in pq.read_table(built.workdir / "prompts/train.parquet").to_pylist()[:2]]
    assert [r["id"] for r in rows] == [f"{p}{v}" for p in prompt_ids for v in ("", "~s1", "~s2")]
    assert [r["kind"] for r in rows] == ["greedy", "sampled", "sampled"] * 2
    for r in rows:
        if r["kind"] == "greedy":  # the greedy reply is the one the graph trains on
            assert r["input_ids"] == fixture[r["id"]]["input_ids"]
    assert any(r["messages"][-1]["content"] != fixture[r["id"].split("~")[0]]["messages"][-1]["content"]
               for r in rows if r["kind"] == "sampled")
    assert (meta["greedy_conversations"], meta["sampled_conversations"], meta["prompts"]) == (2, 4, 2)
    for kind in ("greedy", "sampled"):
        assert meta[f"{kind}_generated_tokens"] == sum(r["generated_tokens"] for r in rows if r["kind"] == kind) > 0
        assert meta[f"{kind}_loss_tokens"] == sum(r["num_loss_tokens"] for r in rows if r["kind"] == kind)
    assert meta["sampling"]["sample_temperature"] == 1.0 and meta["responses_per_prompt"] == 3
    again = run_stage(built.workdir, "generate", {**args, "out": str(tmp_path / "b.parquet")})
    assert again.returncode == 0
    assert pq.read_table(tmp_path / "b.parquet").to_pylist() == rows


def test_a_time_budget_regenerates_what_fits_and_counts_what_it_left_out(built, tmp_path):
    """time_budget_s sizes the data to the machine: a batch that would end past the budget by the time the first
    took is not started, and its conversations are left out, counted; the first batch always runs."""
    args = {"target": built.latest("target_model")["path"], "prompts": str(built.workdir / "prompts/train.parquet"),
            "limit": 6, "max_new_tokens": 8, "dtype": "float32", "batch_size": 2}

    def run(name, budget):
        done = run_stage(built.workdir, "generate", {**args, "out": str(tmp_path / name), "time_budget_s": budget})
        assert done.returncode == 0, done.stderr[-3000:]
        meta = json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
        return meta, pq.read_table(tmp_path / name).to_pylist()

    meta, rows = run("tight.parquet", 0.001)
    # (a later turn of an answered conversation is past the budget too, and counted)
    assert (meta["conversations"], meta["conversations_left_out"]) == (2, 4) and meta["turns_left_out"] >= 4
    assert len(rows) == 2 and all(r["generated_tokens"] > 0 for r in rows) and meta["time_budget_s"] == 0.001
    meta, rows = run("ample.parquet", 600)
    assert (meta["conversations"], meta["conversations_left_out"], len(rows)) == (6, 0, 6)


def test_a_cut_reply_gets_no_end_of_turn_it_never_wrote(built, tmp_path):
    """A reply stopped by max_new_tokens ends at its last token; a finished one ends with the end-of-turn
    token the target emitted, with loss on it."""
    from eagle3_assets.worker.target.model import load_tokenizer

    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": "short", "source": "t", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"id": "long", "source": "t", "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}]),
        prompts)
    target = built.latest("target_model")["path"]
    done = run_stage(built.workdir, "generate", {"target": target, "prompts": str(prompts), "max_new_tokens": 24,
                                                 "dtype": "float32", "out": str(tmp_path / "c.parquet")})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "c.parquet").to_pylist()}
    end = load_tokenizer(Path(target)).convert_tokens_to_ids("<|im_end|>")
    assert rows["short"]["truncated_turns"] == 0 and rows["short"]["input_ids"][-1] == end
    assert rows["short"]["loss_mask"][-1] == 1
    assert rows["long"]["truncated_turns"] == 1 and rows["long"]["generated_tokens"] == 24
    assert end not in rows["long"]["input_ids"][-24:] and rows["long"]["loss_mask"][-24:] == [1] * 24
    assert rows["long"]["num_loss_tokens"] == 24  # the reply's own tokens, nothing after


def test_looping_replies_are_counted_and_fail_the_stage_past_the_share(built, tmp_path):
    target = save_tiny_llama(tmp_path / "tiny-llama")
    args = {"target": str(target), "prompts": str(built.workdir / "prompts/train.parquet"), "limit": 3,
            "max_new_tokens": 40, "dtype": "float32"}
    done = run_stage(built.workdir, "generate", {**args, "out": str(tmp_path / "a.parquet")})
    assert done.returncode == 2 and not (tmp_path / "a.parquet").exists()
    assert "of 3 replies are empty and" in done.stderr and "100% in all, above max_bad_reply_share 50%" in done.stderr, \
        done.stderr[-2000:]
    kept = run_stage(built.workdir, "generate", {**args, "out": str(tmp_path / "b.parquet"), "max_bad_reply_share": 1})
    assert kept.returncode == 0
    meta = json.loads(next(x for x in kept.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
    assert meta["empty_replies"] + meta["degenerate_replies"] == 3 and meta["bad_reply_share"] == 1.0
    # kept as generated all the same: every generated token is in the data, with loss
    assert all(r["num_loss_tokens"] == r["generated_tokens"] > 0 for r in pq.read_table(tmp_path / "b.parquet").to_pylist())


def test_loss_mask_covers_exactly_the_assistant_turns(built, target):
    _, _, tok = target
    row = pq.read_table(built.workdir / "conversations/conversations.parquet").to_pylist()[0]
    ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"], dtype=bool)
    masked_text = tok.decode(ids[mask])
    for m in row["messages"]:
        if m["role"] == "assistant":
            assert m["content"] in masked_text
        elif m["role"] == "user":
            assert m["content"] not in masked_text
    assert tok.decode(ids[~mask]).count("<|im_start|>assistant") == sum(m["role"] == "assistant" for m in row["messages"])


def test_shard_tensors_equal_a_direct_recomputation(built, target):
    _, model, _ = target
    shard = built.workdir / "hidden_states/shard-00001"
    manifest = json.loads((shard / "manifest.json").read_text())
    aux_ids = manifest["aux_layer_ids"]
    assert aux_ids == default_aux_layers(model.config.num_hidden_layers)
    assert manifest["layer_convention"] == "output_of_layer"
    index = pq.read_table(shard / "index.parquet").to_pylist()
    conv = pq.read_table(built.workdir / "conversations/conversations.parquet").to_pylist()
    for row in index:
        part = hidden_states(load_file(str(shard / row["part"])))
        sl = slice(row["offset"], row["offset"] + row["length"])
        ids = conv[row["row"]]["input_ids"]
        assert part["input_ids"][sl].tolist() == ids
        assert part["loss_mask"][sl].tolist() == conv[row["row"]]["loss_mask"]
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        expect_aux = torch.cat([hs[i + 1][0] for i in aux_ids], dim=-1)  # output of layer i
        # equal to float32 noise, or (format v2, the default) to within half an fp8 step of each value
        assert ((part["aux"][sl] - expect_aux).abs() <= part["aux_step"][sl] * 1.01 + 1e-4).all()
        # `final` is pre-norm: the model's own final norm turns it into HF's last hidden state
        with torch.no_grad():
            normed = model.model.norm(part["final"][sl])
        cos = torch.nn.functional.cosine_similarity(normed, hs[-1][0], dim=-1)
        assert cos.min() >= (0.999 if manifest["storage"] == "fp8" else 0.99999), cos.min()


def test_shard_manifest_checksums_and_metadata(built):
    for key in ("00000", "00001"):
        shard = built.workdir / f"hidden_states/shard-{key}"
        manifest = json.loads((shard / "manifest.json").read_text())
        import hashlib

        for f in manifest["files"]:
            data = (shard / f["name"]).read_bytes()
            assert len(data) == f["bytes"] and hashlib.sha256(data).hexdigest() == f["sha256"]
            with safe_open(str(shard / f["name"]), "pt") as st:
                assert st.get_slice("aux").get_shape() == [f["tokens"], 3 * manifest["hidden_size"]]
        meta = built.latest("hidden_state_shards", partition=key)
        assert meta["tokens"] == manifest["tokens"] == sum(f["tokens"] for f in manifest["files"])
        assert meta["bytes"] == manifest["bytes"]
        assert meta["bytes_per_token"] == pytest.approx(manifest["bytes"] / manifest["tokens"], abs=0.1)
        assert meta["tokens_per_s"] > 0


def test_vocab_mapping_invariants_and_frequencies(built):
    meta = built.latest("vocab_mapping")
    st = load_file(str(built.workdir / "vocab/vocab_mapping.safetensors"))
    d2t, t2d = st["d2t"].numpy(), st["t2d"].numpy()
    k, vocab = meta["draft_vocab_size"], meta["target_vocab_size"]
    assert (k, vocab) == (64, 49152) and d2t.shape == (k,) and d2t.dtype == np.int64
    assert t2d.shape == (vocab,) and t2d.dtype == np.bool_ and t2d.sum() == k
    used = np.arange(k) + d2t  # target id of each draft id
    assert np.all(np.diff(used) > 0)  # sorted, unique
    assert np.array_equal(np.nonzero(t2d)[0], used)  # round trip t2d <-> d2t
    # the K most frequent assistant tokens (ties by id), counted independently here
    conv = pq.read_table(built.workdir / "conversations/conversations.parquet").to_pylist()
    counts = np.zeros(vocab, dtype=np.int64)
    for r in conv:
        for t, m in zip(r["input_ids"], r["loss_mask"]):
            counts[t] += m
    ranked = sorted(range(vocab), key=lambda t: (-counts[t], t))[:k]
    assert set(ranked) == set(used.tolist())
    assert meta["loss_tokens_counted"] == counts.sum()


def test_draft_vocab_is_capped_at_the_target_vocab(built):
    built.materialize("vocab_mapping", config={"vocab_mapping": {"config": {"draft_vocab_size": 100000}}})
    meta = built.latest("vocab_mapping")
    assert meta["draft_vocab_size"] == meta["target_vocab_size"] == 49152
    built.materialize("vocab_mapping")  # back to the fixture's mapping for other tests


def test_rerunning_one_shard_rewrites_only_that_shard(built):
    root = built.workdir / "hidden_states"
    snap = lambda key: {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (root / f"shard-{key}").iterdir()}  # noqa: E731
    before0, before1 = snap("00000"), snap("00001")
    sha_before = json.loads((root / "shard-00001/manifest.json").read_text())["files"]
    built.materialize("hidden_state_shards", partition="00001")
    assert snap("00000") == before0
    after1 = snap("00001")
    assert set(after1) == set(before1) and all(after1[n] != before1[n] for n in after1)
    # deterministic extraction: the rewritten shard holds the same bytes
    assert json.loads((root / "shard-00001/manifest.json").read_text())["files"] == sha_before
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp or old dirs left


def test_progress_reaches_the_dagster_run_log(built):
    runs = built.instance.get_run_records()
    texts = [e.user_message for r in runs for e in built.instance.all_logs(r.dagster_run.run_id)]
    extract = [t for t in texts if t.startswith("extract shard-")]
    assert extract and all("tokens/s" in t and "ETA" in t for t in extract)
    assert any(t.startswith("generate:") and "tokens/s" in t for t in texts)


def test_a_multi_turn_conversation_keeps_each_reply_and_no_end_marker_a_cut_one_lacked(target):
    """The sequence of a conversation's last reply: the prompt exactly as fed (earlier replies inside it as the
    template renders them), then the reply's own tokens. Loss on every reply's text, on an earlier reply's end
    marker only where the target wrote one (the first reply here was cut), on none of the user's words."""
    from eagle3_assets.worker.target.chat import render, training_sequence

    _, _, tok = target
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": " Blue, like the"},
            {"role": "user", "content": "And a fruit?"}, {"role": "assistant", "content": "An apple."}]
    prompt = tok(render(tok, msgs[:3], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok("An apple.", add_special_tokens=False)["input_ids"] + [end]
    ids, mask = training_sequence(tok, msgs, prompt, reply, capped=[True, False])
    assert ids == prompt + reply and mask[-len(reply):] == [1] * len(reply)
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert " Blue, like the" in masked and "An apple." in masked and masked.count("<|im_end|>") == 1
    assert "Name a colour" not in masked and "And a fruit" not in masked
    both = training_sequence(tok, msgs, prompt, reply, capped=[False, False])[1]
    assert sum(both) > sum(mask)  # the first reply's end marker, now emitted, carries loss
