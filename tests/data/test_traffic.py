"""The `traffic` asset: the gateway's request logs read as a gateway writes them (JSONL, .gz, globs, fsspec URLs),
each request placed in its day, sampled, redacted before anything is stored, and deduplicated; the end-to-end test
materializes a day through the real `dagster` CLI on a real instance and host work directory, and finds no raw
value in any file there, any log line or any metadata value."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import fsspec
import pyarrow.parquet as pq
import pytest

from conftest import failure_text, served_response
from eagle3_assets.definitions import all_assets
from eagle3_assets.hosts import LocalGpuHost
from eagle3_assets.sources.gateway_logs import TrafficError, TrafficStats, read_day, redacted_rows
from eagle3_assets.sources.redact import KINDS, Redactor

DAY = "2026-12-02"
UTC_DAY = dg.DailyPartitionsDefinition(start_date="2026-01-01").time_window_for_partition_key(DAY)

# One raw value of each kind, as a user might paste it; none may survive the asset anywhere.
RAW = {
    "email": "jane.doe+billing@example-mail.com",
    "phone": "(415) 555-2671",
    "ip_address": "203.0.113.77",
    "ipv6": "2001:db8:85a3::8a2e:370:7334",
    "credit_card": "4111 1111 1111 1111",
    "api_key": "sk-proj-Xq7vB2nLk9PzR4tWm8YcJd3F",
    "bearer_token": "Bearer eyQ9sT3kLm2Vx8RbN4pWz7Yc",
    "national_id": "529.982.247-25",  # a Brazilian CPF, its check digits valid
}
PII_PROMPT = (f"Hi, I'm reachable at {RAW['email']} or {RAW['phone']}. Our server {RAW['ip_address']} (and "
              f"{RAW['ipv6']}) refuses my card {RAW['credit_card']}; the key is {RAW['api_key']} and the header "
              f"says Authorization: {RAW['bearer_token']}; meu CPF é {RAW['national_id']}. Why is the payment "
              f"declined?")
EXPECTED = {"email": 1, "phone": 1, "ip_address": 2, "credit_card": 1, "api_key": 1, "bearer_token": 1,
            "private_key": 0, "url_credential": 0, "national_id": 1, "company_id": 0, "iban": 0}


def _req(text: str, ts=None, **extra) -> dict:
    body = {"model": "served", "messages": [{"role": "user", "content": text}], **extra}
    return body if ts is None else {**body, "timestamp": ts}


def _write(path: Path, records: list, gz: bool = False) -> Path:
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines)
    return path


def _read(sources, window=UTC_DAY, **kw):
    opts = dict(seed=0, keep=100, max_user_turns=8, on_bad_record="fail", timestamp_fields=["timestamp", "created"],
                redactor=Redactor())
    opts.update(kw)
    stats = TrafficStats()
    cands = read_day([str(s) for s in sources], window.start, window.end, stats=stats, **opts)
    return cands, stats


def _texts(cands) -> list[str]:
    return [c.conv.messages[-1]["content"] for c in cands]


def test_each_format_is_read_gz_globs_and_fsspec_urls_too(tmp_path):
    noon = "2026-12-02T12:00:00Z"
    _write(tmp_path / "a.jsonl", [
        _req("bare body, epoch seconds", 1796212800),  # 2026-12-02T12:00:00Z
        {"timestamp": noon, "body": _req("body as an object")},
        {"created": noon, "request": json.dumps(_req("request as JSON text"))},
        {"timestamp": noon, "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "content"}, {"type": "text", "text": "parts"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "user", "content": "after a tool call"}]},
    ])
    _write(tmp_path / "b.jsonl.gz", [_req("from a gzip file", noon)], gz=True)
    _write(tmp_path / "c.ndjson", [_req("ndjson", noon)])
    with fsspec.open("memory://gw/x-1.jsonl", "w") as f:
        f.write(json.dumps(_req("memory one", noon)) + "\n")
    with fsspec.open("memory://gw/x-2.jsonl", "w") as f:
        f.write(json.dumps(_req("memory two", noon)) + "\n")

    cands, stats = _read([tmp_path / "*.jsonl*", tmp_path / "c.ndjson", "memory://gw/x-*.jsonl"])
    texts = {c.conv.messages[0]["content"] for c in cands}
    assert texts >= {"bare body, epoch seconds", "body as an object", "request as JSON text", "from a gzip file",
                     "ndjson", "memory one", "memory two"}
    tool = next(c for c in cands if c.conv.messages[-1]["content"] == "after a tool call")
    assert tool.conv.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "content\nparts"},
                                  {"role": "user", "content": "after a tool call"}]
    assert stats.tool_messages_dropped == 1 and stats.empty_turns_dropped == 1  # the tool result; the emptied call
    assert len(stats.files_read) == 5 and stats.records == stats.in_day == 8
    assert {c.timestamp for c in cands} == {1796212800.0}


def test_timestamps_place_each_request_in_its_day_utc_unless_the_partitions_say(tmp_path):
    log = _write(tmp_path / "gw.jsonl", [
        _req("late the day before", "2026-12-01T23:59:59Z"),
        _req("first second", "2026-12-02T00:00:00Z"),
        _req("half past midnight in Paris is the day before in UTC", "2026-12-02T00:30:00+01:00"),
        _req("no offset is UTC", "2026-12-02T23:59:59.500"),
        _req("epoch seconds as text", "1796255999"),  # 2026-12-02T23:59:59Z
        _req("next day", "2026-12-03T00:00:00Z"),
    ])
    cands, stats = _read([log])
    assert sorted(_texts(cands)) == sorted(["first second", "no offset is UTC", "epoch seconds as text"])
    assert stats.in_day == 3 and dict(stats.other_days) == {"2026-12-01": 2, "2026-12-03": 1}

    new_york = dg.DailyPartitionsDefinition(start_date="2026-01-01", timezone="America/New_York")
    cands, _ = _read([log], window=new_york.time_window_for_partition_key("2026-12-01"))  # until 05:00 UTC on the 2nd
    assert sorted(_texts(cands)) == sorted(["late the day before", "first second",
                                            "half past midnight in Paris is the day before in UTC"])


def test_a_request_without_a_timestamp_is_placed_by_its_files_name_else_refused(tmp_path):
    _write(tmp_path / f"gateway-{DAY}.jsonl", [_req("named by the file"), _req("stamped anyway", "2026-12-03T01:00:00Z")])
    _write(tmp_path / "gateway-20261203.jsonl", [_req("the next day's file")])
    _write(tmp_path / "gateway-2026-11-20.jsonl", ["not even JSON"])  # far from the day: never opened
    cands, stats = _read([tmp_path / "gateway-*.jsonl"])
    assert _texts(cands) == ["named by the file"]
    assert stats.placed_by_file_name == 1 and stats.files_skipped_by_name == 1 and len(stats.files_read) == 2

    undated = _write(tmp_path / "gw.jsonl", [_req("when?")])
    with pytest.raises(TrafficError, match=r"gw.jsonl, line 1: no timestamp .* the file's name carries no date"):
        _read([undated])
    millis = _write(tmp_path / "ms.jsonl", [_req("ms", 1796212800000)])
    with pytest.raises(TrafficError, match=r"ms.jsonl, line 1: timestamp 1796212800000 is not epoch seconds .*"
                                           r"milliseconds\?"):
        _read([millis])


def test_a_line_that_is_not_json_is_named_and_skip_counts_it(tmp_path):
    log = _write(tmp_path / "gw.jsonl", [_req("fine", "2026-12-02T10:00:00Z"), '{"messages": [', _req("also fine", DAY)])
    with pytest.raises(TrafficError, match=r"gw.jsonl, line 2: malformed JSON"):
        _read([log])
    cands, stats = _read([log], on_bad_record="skip")
    assert sorted(_texts(cands)) == ["also fine", "fine"]
    assert stats.bad_records_skipped == 1 and "gw.jsonl, line 2: malformed JSON" in stats.problems[0]


def test_a_request_with_no_user_message_is_counted_not_taken_nor_failed(tmp_path):
    log = _write(tmp_path / "gw.jsonl", [
        {"timestamp": DAY, "messages": [{"role": "system", "content": "you are a bot"}]},
        {"timestamp": DAY, "messages": [{"role": "user", "content": "  "}, {"role": "tool", "content": "result"}]},
        _req("a real prompt", DAY),
    ])
    cands, stats = _read([log])
    assert _texts(cands) == ["a real prompt"] and stats.no_user_message == 2 and stats.bad_records_skipped == 0


def test_the_sample_is_stable_seeded_capped_and_exact_repeats_are_dropped(tmp_path):
    prompts = [f"question number {i}: what is {i} squared?" for i in range(50)]
    log = _write(tmp_path / "gw.jsonl", [_req(p, DAY) for p in prompts] + [_req(prompts[3], DAY)] * 2)
    a, stats = _read([log], keep=10)
    b, _ = _read([log], keep=10)
    shuffled = _write(tmp_path / "shuffled.jsonl", [_req(p, DAY) for p in reversed(prompts)])
    c, _ = _read([shuffled], keep=10)
    assert len(a) == 10 and _texts(a) == _texts(b) == _texts(c)  # the order of the log does not matter
    assert [x.rank for x in a] == sorted(x.rank for x in a)
    assert _texts(_read([log], keep=10, seed=1)[0]) != _texts(a)
    more, _ = _read([log], keep=11)
    assert _texts(more)[:10] == _texts(a) or set(_texts(a)) < set(_texts(more))  # a larger sample keeps the smaller
    full, stats = _read([log], keep=100)
    assert len(full) == 50 and stats.exact_duplicates == 2


@pytest.mark.parametrize("kind, raw", [(k, v) for k, v in RAW.items()])
def test_each_kind_of_personal_data_is_redacted_and_counted(kind, raw):
    text, found = Redactor().redact(f"before {raw} after")
    assert raw not in text and text.startswith("before [") and text.endswith("] after")
    assert found == {("ip_address" if kind == "ipv6" else kind): 1}


def test_redaction_leaves_what_is_no_personal_data():
    for text in ["x[1::2] at 12:30:45, version 1.2.3.4.5, pi 3.14159", "sort 10000 integers in O(n log n)",
                 "the card test number 4111 1111 1111 1112 fails Luhn", "@decorator def f(a, b): return a@b",
                 "meta-llama/Llama-3.1-8B-Instruct on 2026-12-03"]:
        assert Redactor().redact(text) == (text, {}), text
    text, found = Redactor().redact("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----")
    assert found == {"private_key": 1} and "MIIEow" not in text


def test_redaction_comes_before_truncation_so_no_cut_value_survives(tmp_path):
    log = _write(tmp_path / "gw.jsonl", [_req("x" * 20 + " " + RAW["credit_card"], DAY)])
    cands, stats = _read([log])
    rows = redacted_rows(cands, Redactor(), 30, stats)
    assert rows[0]["messages"][0]["content"] == "x" * 20 + " [CREDIT_C"  # cut after: no digits of the card left
    assert stats.redacted == {"credit_card": 1} and stats.messages_truncated == 1


# ---- one day through the real dagster CLI, instance and host work directory ---------------------------------------

def _dagster(home: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "eagle3_assets.definitions",
           *args]
    return subprocess.run(cmd, env={**os.environ, **env, "DAGSTER_HOME": str(home)}, capture_output=True,
                          text=True, timeout=600)


def _all_text(root: Path) -> dict[Path, str]:
    """Every file under `root` as text: Parquet files by their values (their pages may be compressed), gzip files
    decompressed, the rest (SQLite event logs, compute logs, JSON) as bytes decoded."""
    out = {}
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        if p.suffix == ".parquet":
            out[p] = json.dumps(pq.read_table(p).to_pylist(), ensure_ascii=False)
        else:
            data = p.read_bytes()
            out[p] = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode("utf-8", "replace")
    return out


def test_a_day_materialized_through_dagster_holds_no_raw_value_anywhere(tmp_path):
    home, work, logs = tmp_path / "dagster_home", tmp_path / "host-work", tmp_path / "gateway"
    home.mkdir()
    logs.mkdir()
    env = {"EAGLE3_HOST_WORKDIR": str(work), "EAGLE3_TRAFFIC_LOGS": str(logs / "*.jsonl*")}
    done = _dagster(home, env, "--select", "prompts", "--config-json",
                    json.dumps({"ops": {"prompts": {"config": {"include_humaneval": False}}}}))
    assert done.returncode == 0, done.stderr[-3000:]
    held = pq.read_table(work / "prompts/eval.parquet").to_pylist()[0]["messages"][0]["content"]

    ordinary = ["Explain consensus in distributed systems, in plain words for a newcomer to the field.",
                "Write a haiku about autumn rain falling on a tin roof.", "What does the zip function do in Python?",
                "Plan a three day trip to Lisbon on a small budget."]
    _write(logs / f"gw-{DAY}-a.jsonl", [
        _req(PII_PROMPT, "2026-12-02T09:15:00Z"),
        _req(ordinary[0], "2026-12-02T09:16:00Z"), _req(ordinary[1], 1796200200),
        _req(held + "!", "2026-12-02T10:00:00+00:00"),  # a near copy of a held-out prompt
        _req("Please e" + ordinary[0][1:], "2026-12-02T11:00:00Z"),  # a near copy of another request
        '{"messages": [{"role": "user", "content": "cut off',  # a line that is not JSON
        {"timestamp": DAY, "messages": [{"role": RAW["email"], "content": "x"}]},  # its error would quote it
        {"timestamp": DAY, "messages": [{"role": "system", "content": f"mail {RAW['email']}"}]},  # no user message
        _req(f"a day later, {RAW['phone']}", "2026-12-03T08:00:00Z"),
    ])
    _write(logs / f"gw-{DAY}-b.jsonl.gz", [_req(ordinary[2], "2026-12-02T20:00:00Z"),
                                           _req(f"{ordinary[3]} Reply to {RAW['email']}", "2026-12-02T21:00:00Z")],
           gz=True)
    done = _dagster(home, env, "--select", "traffic", "--partition", DAY, "--config-json",
                    json.dumps({"ops": {"traffic": {"config": {"on_bad_record": "skip", "max_prompts": 50}}}}))
    assert done.returncode == 0, done.stderr[-3000:]

    with dg.DagsterInstance.from_config(str(home)) as instance:
        ev = instance.get_latest_materialization_event(dg.AssetKey("traffic"))
        meta = {k: v.value for k, v in ev.asset_materialization.metadata.items()}
        records = instance.get_records_for_run(ev.run_id).records
        logged = [r.event_log_entry.user_message or "" for r in records]
    texts = {**_all_text(home), **_all_text(work)}
    assert any(p.parent.name == "compute_logs" for p in texts), "no compute log captured: the check below sees none"
    assert any("traffic sample:" in t for p, t in texts.items() if p.parent.name == "compute_logs" or p.suffix == ".db")
    assert any("[CREDIT_CARD]" in t for p, t in texts.items() if p.suffix == ".parquet")  # the scan reads values
    printed = done.stdout + done.stderr  # the CLI's own log lines
    for kind, raw in RAW.items():
        found = [str(p.relative_to(tmp_path)) for p, t in texts.items() if raw in t]
        assert not found, f"the raw {kind} is in {found}"
        assert not [k for k, v in meta.items() if raw in str(v)], kind
        assert not [m for m in logged if raw in m] and raw not in printed, kind

    assert {k: meta[f"redacted_{k}"] for k in KINDS} == {**EXPECTED, "email": 2}  # the system-only one: not taken
    assert (meta["requests_read"], meta["requests_in_day"], meta["requests_other_days"]) == (11, 9, 1)
    assert (meta["bad_records_skipped"], meta["no_user_message"]) == (2, 1)
    assert (meta["near_duplicates_of_held_out"], meta["near_duplicates_within"], meta["prompts"]) == (1, 1, 5)
    assert meta["files_read"] == 2 and meta["dagster/row_count"] == 5 and meta["sample_short"] is False
    assert any("skipped:" in m and "unknown role '[EMAIL]'" in m for m in logged)  # the problem, redacted

    kept = pq.read_table(work / f"traffic/{DAY}.parquet").to_pylist()
    pii = next(r for r in kept if "payment declined" in r["messages"][0]["content"])["messages"][0]["content"]
    assert pii.count("[EMAIL]") == 1 and all(f"[{k}]" in pii for k in ("CREDIT_CARD", "BEARER_TOKEN", "NATIONAL_ID"))
    assert {r["length_bucket"] for r in kept} == {"<256"} and "explain consensus in" in {r["first_words"] for r in kept}
    assert not list(work.glob("traffic/.candidates-*"))



def test_a_partition_failing_on_a_bad_line_quotes_no_raw_value(tmp_path):
    """on_bad_record 'fail': the failure names the file and line, in redacted words, and keeps no raw cause."""
    log = _write(tmp_path / "gw.jsonl", [{"timestamp": DAY, "messages": [{"role": RAW["email"], "content": "x"}]}])
    host = LocalGpuHost(workdir=str(tmp_path / "work"))
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        run = dict(assets=all_assets, instance=instance, resources={"gpu_host": host})
        assert dg.materialize(selection=["prompts"], **run, run_config={
            "ops": {"prompts": {"config": {"include_humaneval": False}}}}).success
        res = dg.materialize(selection=["traffic"], partition_key=DAY, raise_on_error=False, **run, run_config={
            "ops": {"traffic": {"config": {"sources": [str(log)]}}}})
        assert not res.success
        text = failure_text(res)
        assert "gw.jsonl, line 1: unknown role '[EMAIL]'" in text and RAW["email"] not in text
        events = [str(r.event_log_entry) for r in instance.get_records_for_run(res.run_id).records]
        assert events and not [e for e in events if RAW["email"] in e]
    assert not (tmp_path / "work" / "traffic").exists()  # nothing reached the host


def test_a_day_with_no_requests_is_materialized_empty_and_says_so(tmp_path):
    """The daily read of a day the gateway served nothing (its logs hold other days only): an empty partition whose
    day_status says why, not a failure and not a missing day."""
    log = _write(tmp_path / "gw.jsonl", [_req("what is a monad", "2026-12-01T08:00:00Z")])
    host = LocalGpuHost(workdir=str(tmp_path / "work"))
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        run = dict(assets=all_assets, instance=instance, resources={"gpu_host": host})
        assert dg.materialize(selection=["prompts"], **run, run_config={
            "ops": {"prompts": {"config": {"include_humaneval": False}}}}).success
        assert dg.materialize(selection=["traffic"], partition_key=DAY, **run, run_config={
            "ops": {"traffic": {"config": {"sources": [str(log)]}}}}).success
        ev = instance.get_latest_materialization_event(dg.AssetKey("traffic"))
        meta = {k: v.value for k, v in ev.asset_materialization.metadata.items()}
    assert meta["requests_in_day"] == 0 and meta["prompts"] == 0
    assert meta["day_status"] == f"empty: none of the 1 requests read is of {DAY} (they are of 2026-12-01 to 2026-12-01)"


def test_a_logged_responses_per_request_figures_and_the_named_fields_travel_with_the_request(tmp_path):
    ts = UTC_DAY.start.timestamp() + 60
    log = _write(tmp_path / "gw.jsonl", [
        {"timestamp": ts, "body": _req("Why is the sky blue?"), "response": served_response([2, 1, 3, 0]),
         "tenant": "acme", "metadata": {"route": "/v1/chat/completions"}},
        {"timestamp": ts, "request": json.dumps(_req("Pourquoi le ciel est-il bleu ?")),
         "response": json.dumps(served_response([0, 0, 1])), "tenant": RAW["email"]},  # as text; a tenant that is personal
        {"timestamp": ts, "body": _req("No response was logged with this one.")},
    ])
    cands, stats = _read([log], fields=["tenant", "metadata.route", "absent"])
    assert stats.with_served == 2
    by_text = {c.conv.messages[-1]["content"]: c for c in cands}
    english = by_text["Why is the sky blue?"]
    assert english.served == {"served_steps": 4, "served_accepted": 6, "served_drafted": 12, "served_k": 3}
    assert english.fields == {"tenant": "acme", "metadata.route": "/v1/chat/completions"}
    assert by_text["No response was logged with this one."].served is None
    rows = {r["messages"][-1]["content"]: r for r in redacted_rows(cands, Redactor(), 8000, stats)}
    french = rows["Pourquoi le ciel est-il bleu ?"]
    assert (french["served_steps"], french["served_accepted"]) == (3, 1)
    assert RAW["email"] not in json.dumps(rows) and json.loads(french["gateway_fields"]) == {"tenant": "[EMAIL]"}
    assert rows["No response was logged with this one."]["served_steps"] is None


@pytest.mark.parametrize("figures, says", [
    ({"num_spec_steps": "4"}, "num_spec_steps is a string, not a count"),
    ({"num_accepted_draft_tokens": 99}, "more draft tokens accepted (99) than proposed (12)"),
])
def test_a_response_whose_figures_are_not_vllms_is_a_bad_record_named(tmp_path, figures, says):
    resp = served_response([2, 1, 3, 0])
    resp["metrics"]["speculative_decoding"].update(figures)
    log = _write(tmp_path / "gw.jsonl", [{"timestamp": UTC_DAY.start.timestamp(), "body": _req("Hi"),
                                          "response": resp}])
    with pytest.raises(TrafficError, match="line 1") as e:
        _read([log])
    assert says in str(e.value) and "on_bad_record='skip'" in str(e.value)
    cands, stats = _read([log], on_bad_record="skip")
    assert not cands and stats.bad_records_skipped == 1
