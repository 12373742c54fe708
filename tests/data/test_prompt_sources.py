"""Prompt formats and cleaning, through the real `prompts` asset where it matters."""

from __future__ import annotations

import gzip
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import failure_text
from eagle3_assets.sources.prompt_files import LoadStats, PromptError, is_eval, load_source


def _load(src, **kw):
    opts = dict(max_user_turns=8, max_message_chars=8000, on_bad_record="fail", stats=LoadStats())
    opts.update(kw)
    return list(load_source(src, **opts)), opts["stats"]


def test_sharegpt_ultrachat_openai_and_parquet_normalize_alike(tmp_path):
    turns = ["What is 2+2?", "4.", "And 3+3?"]
    share = tmp_path / "a.json"
    share.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": turns[0]},
                                                               {"from": "gpt", "value": turns[1]},
                                                               {"from": "human", "value": turns[2]}]}]))
    ultra = tmp_path / "b.jsonl.gz"
    with gzip.open(ultra, "wt") as f:
        f.write(json.dumps({"data": turns}) + "\n")
    parquet = tmp_path / "c.parquet"
    msgs = [{"role": r, "content": c} for r, c in zip(["user", "assistant", "user"], turns)]
    pq.write_table(pa.Table.from_pylist([{"messages": msgs}]), parquet)
    with fsspec.open("memory://d.jsonl", "w") as f:  # any fsspec URL
        f.write(json.dumps({"messages": msgs}) + "\n")
    got = [_load(str(s))[0][0].messages for s in (share, ultra, parquet)] + [_load("memory://d.jsonl")[0][0].messages]
    assert all(g == msgs for g in got)
    assert _load(str(share))[0][0].id == "x"


def test_empty_turns_dropped_long_messages_and_turns_capped(tmp_path):
    f = tmp_path / "x.jsonl"
    msgs = [{"role": "user", "content": "a" * 50}, {"role": "assistant", "content": " "},
            {"role": "user", "content": "second"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "third"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    (conv,), stats = _load(str(f), max_user_turns=2, max_message_chars=10)
    assert conv.messages == [{"role": "user", "content": "a" * 10}, {"role": "user", "content": "second"},
                             {"role": "assistant", "content": "ok"}]
    assert (stats.empty_turns_dropped, stats.messages_truncated, stats.turns_capped) == (1, 1, 1)


def test_bundled_set_is_varied_and_clean():
    convs, stats = _load("bundled")
    assert len(convs) >= 300 and stats.empty_turns_dropped == 0
    cats = {c.id.split("-")[0] for c in convs}
    assert {"chat", "code", "maths", "writing", "multiturn"} <= cats
    assert sum(sum(m["role"] == "user" for m in c.messages) > 1 for c in convs) >= 50
    assert len({c.key for c in convs}) == len(convs)


def test_single_turn_set_gives_the_recipe_400_training_prompts_and_a_disjoint_held_out_split():
    from eagle3_assets.sources.prompt_files import split

    convs, stats = _load("single-turn")
    assert len(convs) == 560 and stats.empty_turns_dropped == 0
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in convs)
    cats = {c.id.split("-")[1] for c in convs}
    assert cats == {"code", "maths", "explanations", "writing", "advice", "trivia"}
    train, held = split(convs, 0.25, 400)
    assert len(train) == 400 and len(held) >= 100
    # the file is ordered by category: the cap samples across it, not its head (which dropped only trivia)
    uncapped = split(convs, 0.25)[0]
    for cat in cats:
        share = sum(c.id.split("-")[1] == cat for c in train) / 400
        assert abs(share - sum(c.id.split("-")[1] == cat for c in uncapped) / len(uncapped)) < 0.02, cat
    assert not {c.key for c in train} & {c.key for c in held}
    bundled = {c.key for c in _load("bundled")[0]}
    assert not bundled & {c.key for c in convs}  # no prompt of the other shipped set reappears


def test_split_is_stable_when_prompts_are_added():
    convs, _ = _load("bundled")
    before = {c.key for c in convs[:150] if is_eval(c.key, 0.1)}
    after = {c.key for c in convs if is_eval(c.key, 0.1)}
    assert before and before <= after  # adding prompts never moves an eval prompt into training


def test_capped_training_split_is_stable_when_prompts_are_added():
    from eagle3_assets.sources.prompt_files import cap

    convs, _ = _load("bundled")
    before = {c.key for c in cap(convs[:150], 40)}
    after = {c.key for c in cap(convs, 40)}
    assert len(before) == len(after) == 40
    old_kept_after = {c.key for c in convs[:150]} & after
    assert old_kept_after <= before  # an added prompt may take a place; an old prompt never swaps in
    assert [c.key for c in cap(convs, 40)] == [c.key for c in convs if c.key in after]  # file order kept


def test_prompts_asset_deduplicates_across_sources(graph, tmp_path):
    f = tmp_path / "dupes.jsonl"
    bundled_first = _load("bundled")[0][0].messages
    rows = [{"messages": bundled_first}, {"messages": [{"role": "user", "content": "fresh question?"}]},
            {"messages": [{"role": "user", "content": "fresh question?"}, {"role": "assistant", "content": "x"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = graph.materialize("prompts", config={"prompts": {"config": {"sources": ["bundled", str(f)],
                                                                          "eval_fraction": 0.0}}})
    meta = {k: v.value for k, v in res.asset_materializations_for_node("prompts")[0].metadata.items()}
    assert meta["duplicates_dropped"] == 2  # same user turns = same conversation to regenerate
    assert meta["train_by_source"][str(f)] == 1
    graph.materialize("prompts")  # restore the fixture's prompts


GOOD = {"messages": [{"role": "user", "content": "fine question?"}]}
MESSAGE_SHAPE = "each message must be an object with role and content"


def _raises(src, **kw) -> str:
    with pytest.raises(PromptError) as e:
        _load(src, **kw)
    return str(e.value)


@pytest.mark.parametrize("content", ["5", "null", '"a ShareGPT file"', "true"])
def test_json_file_holding_a_scalar_names_the_file_and_the_shape_expected(tmp_path, content):
    f = tmp_path / "prompts.json"
    f.write_text(content)
    msg = _raises(str(f))
    assert msg.startswith(f"{f}: the file's JSON is ")
    assert "expected a list of records or an object with a list under 'data'" in msg
    # not one bad record but no prompt file at all (a string is no list of characters): skip cannot help
    assert _raises(str(f), on_bad_record="skip") == msg


def test_messages_that_are_strings_name_the_file_record_and_shape(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({"messages": ["hi", "there"]}) + "\n")
    msg = _raises(str(f))
    assert f"{f}, line 2: messages[0] is a string, not an object" in msg and MESSAGE_SHAPE in msg
    convs, stats = _load(str(f), on_bad_record="skip")
    assert [c.messages for c in convs] == [GOOD["messages"]]
    assert (stats.records, stats.bad_records_skipped, stats.problems) == (2, 1, [msg])


BAD_RECORDS = {  # record -> what the error says was found and expected
    "number": (5, "the record is a number, not an object: expected a JSON object with 'conversations'"),
    "string": ("hi", "the record is a string, not an object"),
    "null": (None, "the record is null, not an object"),
    "list": ([GOOD], "the record is a list, not an object"),
    "message null": ({"messages": [None]}, f"messages[0] is null, not an object: {MESSAGE_SHAPE}"),
    "message list": ({"messages": [["user", "hi"]]}, "messages[0] is a list, not an object"),
    "sharegpt turn string": ({"conversations": ["hi"]},
                             "conversations[0] is a string, not an object: each turn must be an object with from "
                             "and value"),
    "messages string": ({"messages": "hi"}, "'messages' is a string: expected a list of {role, content} messages"),
    "conversations object": ({"conversations": {"from": "human", "value": "hi"}},
                             "'conversations' is an object: expected a list of {from, value} turns"),
    "prompt number": ({"prompt": 5}, "'prompt' is a number: expected a string"),
    "content number": ({"messages": [{"role": "user", "content": 5}]},
                       "a user turn's content is a number: expected a string or a list of text parts"),
    "content boolean": ({"messages": [{"role": "user", "content": True}]}, "a user turn's content is a boolean"),
    "sharegpt value number": ({"conversations": [{"from": "human", "value": 7}]},
                              "a user turn's content is a number"),
    "ultrachat turn number": ({"data": [5, "x"]}, "a user turn's content is a number"),
    "content part number": ({"messages": [{"role": "user", "content": ["hi", 5]}]},
                            "a user turn holds a content part that is a number"),
    "text part text number": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                              "a user turn holds a text part whose 'text' is a number: expected a string"),
}


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
@pytest.mark.parametrize("name", BAD_RECORDS)
def test_record_of_an_unexpected_shape_is_named_or_skipped_and_counted(tmp_path, fmt, name):
    rec, expected = BAD_RECORDS[name]
    f = tmp_path / f"chats.{fmt}"
    if fmt == "jsonl":
        f.write_text(json.dumps(GOOD) + "\n" + json.dumps(rec) + "\n")
        place = f"{f}, line 2"
    else:  # a JSON object wrapping the list, as exported datasets do
        f.write_text(json.dumps({"data": [GOOD, rec]}))
        place = f"{f}, record 1"
    msg = _raises(str(f))
    assert msg.startswith(f"{place}: ") and expected in msg and "on_bad_record='skip'" in msg
    convs, stats = _load(str(f), on_bad_record="skip")
    assert [c.messages for c in convs] == [GOOD["messages"]]
    assert (stats.bad_records_skipped, stats.problems) == (1, [msg])


@pytest.mark.parametrize("rec, expected", [
    ({"messages": ["hi", "there"]}, f"messages[0] is a string, not an object: {MESSAGE_SHAPE}"),
    ({"messages": [{"role": "user", "content": 5}]}, "a user turn's content is a number"),
], ids=["message string", "content number"])
def test_parquet_record_of_an_unexpected_shape_is_named_or_skipped_and_counted(tmp_path, rec, expected):
    f = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([rec, rec]), f)  # a column has one type: every row has the bad shape
    msg = _raises(str(f))
    assert msg.startswith(f"{f}, record 0: ") and expected in msg
    convs, stats = _load(str(f), on_bad_record="skip")
    assert (convs, stats.bad_records_skipped, stats.problems[0]) == ([], 2, msg)


def test_prompts_asset_names_the_string_messages_record_and_counts_it_when_skipped(graph, tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({"messages": ["hi", "there"]}) + "\n")
    cfg = {"sources": [str(f)], "include_humaneval": False, "eval_fraction": 0.0}
    res = graph.materialize("prompts", config={"prompts": {"config": cfg}}, raise_on_error=False)
    assert not res.success
    assert f"{f}, line 2: messages[0] is a string, not an object: {MESSAGE_SHAPE}" in failure_text(res)
    assert "AttributeError" not in failure_text(res)
    ok = graph.materialize("prompts", config={"prompts": {"config": {**cfg, "on_bad_record": "skip"}}})
    meta = {k: v.value for k, v in ok.asset_materializations_for_node("prompts")[0].metadata.items()}
    assert (meta["bad_records_skipped"], meta["train_conversations"]) == (1, 1)
    graph.materialize("prompts")  # restore the fixture's prompts
