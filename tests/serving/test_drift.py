"""Drift, without a server: the prompt keys a report groups traffic by, the live judgement and its window over real
observations in a real instance, the servers file's drift section, and the offline replay (`traffic_acceptance`)
and `drift_report` materialized on the shared graph's drafter over a day of traffic written as a gateway writes it.
The whole loop with a real vLLM server and the daemon: test_serving_eye.py."""

import json
import os
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import TINY_TRAIN, served_response
from eagle3_assets.eye import served
from eagle3_assets.eye.drift import check_evaluation, judge
from eagle3_assets.eye.drift_report import where
from eagle3_assets.eye.servers_file import DriftSettings, Server, asset_key, load_servers
from eagle3_assets.story.gateway import OTHER_LANGUAGES
from eagle3_assets.worker.data.prompt_groups import kind
from eagle3_assets.worker.serving.traffic_replay import groups


@pytest.mark.parametrize("text, expected", [
    ("Convert this JSON to CSV:\n[\n  {\"id\": 1, \"city\": \"Lyon\"},\n  {\"id\": 2, \"city\": \"Osaka\"}\n]", "structured"),
    ("2026-11-13T09:35:00Z WARN svc=search code=503\n2026-11-13T09:36:00Z INFO svc=auth code=200\n"
     "2026-11-13T09:37:00Z ERROR svc=auth code=500\nCount the lines per level.", "structured"),
    ("```yaml\nreplicas: 3\n```\nWhat does this do?", "structured"),
    ("Pourquoi le ciel est-il bleu pendant la journée ?", "other-language"),
    ("¿Cómo se prepara una tortilla de patatas tradicional?", "other-language"),
    ("Почему небо голубое?", "other-language"),
    ("Write a Python function that reverses a linked list.", "code"),
    ("```\nint main() { return 0; }\n```\nWhy does this compile?", "code"),
    ("Solve 3x + 5 = 20 for x.", "math"),
    ("Give me three tips for sleeping better after a night shift.", "prose"),
])
def test_a_prompts_kind_is_read_off_its_text(text, expected):
    assert kind(text) == expected


def test_the_shipped_chat_prompts_are_english_and_the_gateways_new_kind_is_not():
    from eagle3_assets.sources.prompt_files import SINGLE_TURN, LoadStats, load_source

    convs = list(load_source(SINGLE_TURN, max_user_turns=8, max_message_chars=8000, on_bad_record="fail",
                             stats=LoadStats()))
    shipped = [kind(c.messages[-1]["content"]) for c in convs]
    assert shipped.count("other-language") <= 1  # one prompt quotes another language
    assert sum(kind(t) == "other-language" for t in OTHER_LANGUAGES) >= 0.9 * len(OTHER_LANGUAGES)


def _res(*accepted: int) -> dict:
    return {"accepted": list(accepted)}


def test_groups_sum_acceptance_as_the_engines_count_it_and_name_the_group_below_the_eval_figure():
    rows = [{"kind": "prose", "length_bucket": "<256", "first_words": "why is the"}] * 4 + \
           [{"kind": "other-language", "length_bucket": "<256", "first_words": "pourquoi le ciel"}] * 3 + \
           [{"kind": "code", "length_bucket": "256-1k", "first_words": "write a python"}] * 2
    results = [_res(2, 1, 3)] * 4 + [_res(0, 0, 1, 0)] * 3 + [_res(0)] * 2
    training = [{"kind": "prose", "length_bucket": "<256", "first_words": "x"}] * 9 + \
               [{"kind": "code", "length_bucket": "<256", "first_words": "x"}]
    out = groups(rows, results, rows[:4], results[:4], training, min_group=3)
    by = {(g["by"], g["value"]): g for g in out}
    assert ("kind", "code") not in by  # 2 prompts: under min_group
    foreign = by[("kind", "other-language")]
    assert foreign["acceptance_length"] == pytest.approx((4 + 1) / 4)  # (accepted + 1) per step, over its 12 steps / 3
    assert foreign["share"] == pytest.approx(3 / 9, abs=1e-4) and foreign["train_share"] == 0.0
    assert by[("kind", "prose")]["acceptance_length"] == pytest.approx(3.0)
    assert by[("kind", "prose")]["eval_acceptance_length"] == pytest.approx(3.0)
    assert out[0]["acceptance_length"] <= out[-1]["acceptance_length"]  # lowest first
    low = where(out, reference=2.5, drop=0.1)
    assert [(g["by"], g["value"]) for g in low][:2] == [("kind", "other-language"), ("length_bucket", "<256")]
    assert where(out, reference=None, drop=0.1) == []


def test_the_live_judgement_says_why_it_does_not_judge():
    s = DriftSettings(min_drafts=100, live_drop=0.1)
    win = {"acceptance_length": 1.5, "num_drafts": 500, "k": 3}
    info = {"benchmark_acceptance_length": 2.0, "benchmark_k": 3}
    assert judge("/d", win, info, s)["state"] == "drift" and judge("/d", win, info, s)["drop"] == 0.25
    assert judge("/d", {**win, "acceptance_length": 1.85}, info, s)["state"] == "fits"
    assert "fewer than drift.min_drafts" in judge("/d", {**win, "num_drafts": 99}, info, s)["why"]
    assert "no benchmark" in judge("/d", win, {"benchmark_acceptance_length": None}, s)["why"]
    other_k = judge("/d", {**win, "k": 5}, info, s)  # another k and no figures per position: how to make them compare
    assert other_k["state"] == "unknown" and "{speculative_config}" in other_k["why"]
    assert "benchmark it at k=5" in other_k["why"]
    assert judge(None, win, info, s)["state"] == "unknown"


def test_a_server_at_another_k_is_judged_on_the_draft_positions_both_measured():
    """Issue 58, 5: a server started at k = 3 by an older restart command, its drafter benchmarked at the schedule's
    k = 2. A chain draft's position i is accepted or not whatever follows it, so the first two positions compare:
    1.32 served against 1.77 benchmarked is a drift (it was 'not judged' for as long as it served); the same positions
    at the benchmark's figures fit."""
    s = DriftSettings(min_drafts=100, live_drop=0.1)
    info = {"benchmark_acceptance_length": 1.77, "benchmark_k": 2, "benchmark_acceptance_per_pos": [0.5, 0.27]}
    drifted = {"acceptance_length": 1.35, "num_drafts": 1276, "k": 3, "acceptance_per_pos": [0.22, 0.1, 0.03]}
    got = judge("/d", drifted, info, s)
    assert got["state"] == "drift" and got["compared"][:2] == [1.32, 1.77], got
    assert "over the first 2 draft positions (served with k=3, benchmarked with k=2)" in got["why"]
    fits = {**drifted, "acceptance_length": 1.9, "acceptance_per_pos": [0.5, 0.27, 0.13]}
    assert judge("/d", fits, info, s)["state"] == "fits"  # its whole 1.90 would read as 7 % above the benchmark


def test_not_judged_is_a_warning_not_a_pass_and_a_long_blind_spell_is_an_error():
    s = DriftSettings(min_drafts=100, unjudged_after_s=3600)
    server = Server(name="prod", url="http://127.0.0.1:1")
    win = {"acceptance_length": 1.5, "num_drafts": 500, "k": 3}
    info = {"benchmark_acceptance_length": None, "benchmark_k": None, "checkpoint": None, "benchmark_from": None}
    state = {"drafter": "/d", "window": win, "info": info, **judge("/d", win, info, s)}
    blind = check_evaluation(server, state, unjudged_s=600, settings=s)
    assert not blind.passed and blind.severity == dg.AssetCheckSeverity.WARN
    assert blind.description.startswith("not judged: no benchmark of the drafter served")
    assert blind.metadata["unjudged_s"].value == 600
    long = check_evaluation(server, state, unjudged_s=3700, settings=s)
    assert not long.passed and long.severity == dg.AssetCheckSeverity.ERROR
    assert long.description.startswith("not judged for 62 min (drift.unjudged_after_s 3600 s): no benchmark")
    info = {**info, "benchmark_acceptance_length": 1.6, "benchmark_from": "serving_benchmark ..."}
    fits = check_evaluation(server, {"drafter": "/d", "window": win, "info": info, **judge("/d", win, info, s)}, 0, s)
    assert fits.passed and fits.metadata["reference"].value == "serving_benchmark ..."


def test_a_drafter_the_loop_promoted_is_judged_against_its_gate_figures_and_the_next_loop_against_the_newer():
    """The loop's drafters have no serving_benchmark: the eye ties a served challenger_export to its checkpoint and
    holds it to the eval figure the gate measured it at; once a second gate held it as champion, to that one."""
    first, second = "c" * 32, "d" * 32

    def gate(instance, champion, challenger, champ_al, chall_al):
        instance.report_runless_asset_event(dg.AssetMaterialization("promotion_gate", partition="vllm", metadata={
            "champion": champion, "challenger": challenger, "num_speculative_tokens": 3, "max_new_tokens": 64,
            "figures": dg.MetadataValue.json({"champion": {"eval": {"acceptance_length": champ_al}},
                                              "challenger": {"eval": {"acceptance_length": chall_al}}})}))

    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization(
            "challenger_export", metadata={"vllm_path": f"/srv/exports/{first[:12]}/vllm"},
            tags={"dagster/input_data_version/challenger_drafter": first}))
        server = Server(name="prod", url="http://127.0.0.1:1", engine="vllm")
        # copied to the serving machine: the path differs, the export's directory name does not
        served_path = f"/models/exports/{first[:12]}/vllm"
        assert served.checkpoint(instance, served_path) == first
        gate(instance, "a" * 32, first, 1.93, 1.90)
        info = served.describe(instance, server, served_path)
        assert info["checkpoint"] == first and info["benchmark_acceptance_length"] == 1.90 and info["benchmark_k"] == 3
        assert "promotion_gate" in info["benchmark_from"] and \
            info["benchmark_from"].endswith("the challenger's acceptance on the eval set, k=3, 64 new tokens")
        gate(instance, first, second, 1.84, 1.80)  # the second loop: the first's challenger is its champion
        info = served.describe(instance, server, served_path)
        assert info["benchmark_acceptance_length"] == 1.84 and "the champion's acceptance" in info["benchmark_from"]
        assert served.describe(instance, server, "/srv/exports/unknown/vllm")["benchmark_acceptance_length"] is None


def test_the_servers_files_drift_section_is_checked_naming_the_field(tmp_path):
    f = tmp_path / "servers.yaml"
    f.write_text("servers: [{name: a, url: 'http://127.0.0.1:1'}]\ndrift: {live_drop: 1.5, windw_s: 60}\n")
    with pytest.raises(ValueError, match=r"drift\.live_drop: .*less than 1.*drift\.windw_s: Extra inputs"):
        load_servers(str(f))
    f.write_text("servers: [{name: a, url: 'http://127.0.0.1:1'}]\n")
    assert load_servers(str(f)).drift == DriftSettings()


def _observe(instance, drafter: str, al: float, drafts: int, status: str = "ok") -> None:
    instance.report_runless_asset_event(dg.AssetObservation(asset_key=asset_key("prod"), metadata={
        "status": status, "drafter": drafter, "num_drafts": drafts, "num_accepted_tokens": round((al - 1) * drafts),
        "acceptance_length": al, "acceptance_per_pos": json.dumps([round(x * (al - 1), 4) for x in (0.5, 0.3, 0.2)])}))


def test_the_live_window_sums_every_step_of_the_drafter_served_since_its_start(tmp_path):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        t0 = time.time()
        _observe(instance, "/old", 1.2, 1000)  # another drafter's: not in this one's window
        _observe(instance, "/new", 3.0, 10, status="first read: figures since the server started")  # span unknown
        _observe(instance, "/new", 2.0, 100)
        _observe(instance, "/new", 1.5, 300, status="restarted: its counters went back; a new window")
        obs = served.observations(instance, "prod", since=t0 - 1)
        assert served.serving_now(obs) == "/new"
        win = served.window(obs, "/new", t0 - 1)
        assert win["num_drafts"] == 400 and win["acceptance_length"] == pytest.approx(1 + (100 + 150) / 400)
        assert win["k"] == 3 and win["observations"] == 2
        assert served.window(obs, "/new", time.time() + 1)["num_drafts"] == 0  # outside the window
        info = served.describe(instance, Server(name="prod", url="http://x", benchmark_acceptance_length=2.0), "/new")
        assert info["benchmark_acceptance_length"] == 2.0 and "servers file" in info["benchmark_from"]
        assert info["checkpoint"] is None


@pytest.fixture(scope="module")
def drifted_day(built, tmp_path_factory):
    """The shared graph's drafter (trained briefly, exported) and today's gateway log: English chat, then French
    (one request with an e-mail address), each logged with its response as vLLM returns it with per-request metrics
    (the English at 2 drafts accepted a step, the French at 1 in 5 steps), read into today's traffic partition."""
    built.materialize("eagle3_drafter", "drafter_export",
                      config={"eagle3_drafter": {"config": {**TINY_TRAIN, "run_name": "drift"}}})
    log = Path(tmp_path_factory.mktemp("gateway")) / "requests.jsonl"
    english = ["Why do cats purr when they are happy?", "Explain how a bicycle stays upright.",
               "What is a good way to start learning the guitar?", "How do vaccines train the immune system?"]
    foreign = OTHER_LANGUAGES[:4]
    foreign[0] += " Écris-moi à jeanne.martin@exemple-mail.fr."
    now = time.time()
    log.write_text("".join(json.dumps({"timestamp": now, "body": {"model": "m", "messages": [
        {"role": "user", "content": t}]}, "response": served_response([2] * 20 if t in english else [1, 0, 0, 0, 0] * 4),
        "tenant": "fr-team" if t in foreign else "en-team"}) + "\n" for t in english + foreign))
    day = dg.DailyPartitionsDefinition(start_date="2026-01-01", end_offset=1).get_last_partition_key()
    built.materialize("traffic", partition=day, config={"traffic": {"config": {"sources": [str(log)],
                                                                             "group_fields": ["tenant"]}}})
    return built, day


def test_the_replay_groups_todays_traffic_and_the_report_says_where_without_raw_text(drifted_day):
    built, day = drifted_day
    replay = {"limit": 8, "eval_limit": 4, "max_new_tokens": 8, "min_group": 3, "lowest": 3}
    done = built.materialize("traffic_acceptance", partition=day, config={"traffic_acceptance": {"config": replay}})
    meta = built.latest("traffic_acceptance", day)
    export = built.latest("drafter_export")
    assert meta["drafter"] == export["vllm_path"] and meta["checkpoint"] == built.data_version("eagle3_drafter")
    assert meta["prompts"] == 8 and meta["eval_prompts"] == 4 and "replayed here" in meta["eval_reference"]
    kinds = {g["value"]: g for g in meta["groups"] if g["by"] == "kind"}
    assert kinds["other-language"]["prompts"] == 4 and kinds["other-language"]["train_share"] == 0.0
    per_prompt = pq.read_table(meta["path"]).to_pylist()
    assert len(per_prompt) == 8 and {p["kind"] for p in per_prompt} >= {"other-language"}
    assert all(p["verify_steps"] >= 1 for p in per_prompt)
    check = done.get_asset_check_evaluations()[0]
    assert check.check_name == "fits_traffic" and check.passed == (not meta["drift"])

    rec = built.instance.fetch_materializations(dg.AssetKey("traffic_acceptance"), limit=1).records[0]
    built.materialize("drift_report", config={"drift_report": {"config": {
        "signal": "offline", "traffic_day": day, "traffic_acceptance_storage_id": rec.storage_id}}})
    report = built.latest("drift_report")
    assert report["traffic_acceptance_length"] == meta["acceptance_length"]
    assert report["eval_acceptance_length"] == meta["eval_acceptance_length"]
    assert report["signals_fired"] == ("offline" if meta["drift"] else "none")
    assert "### Acceptance per group of the traffic, replayed" in report["report"] and "other-language" in report["report"]
    assert "### Acceptance per group, as production served it" in report["report"]  # the day's served figures beside
    every = json.dumps([meta, report], default=str) + "".join(
        p.read_text(errors="replace") for p in Path(built.workdir, "traffic").rglob("*") if p.suffix == ".log")
    assert "jeanne.martin@" not in every


def test_a_first_position_accepted_almost_never_is_a_suspected_collapse_judged_at_every_k_alike():
    """Issue 58, 6: a fixed acceptance length of 1.1 means a broken drafter at k = 3 but a 10 % rate, a weak drafter,
    at k = 1. The window's first draft position (its acceptance does not depend on k) is held to the benchmark's."""
    s = DriftSettings(min_drafts=100, collapse_below=1.1, collapse_ratio=0.25)
    server = Server(name="prod", url="http://127.0.0.1:1")
    info = {"benchmark_acceptance_length": None, "benchmark_k": None, "checkpoint": None, "benchmark_from": None}
    win = {"acceptance_length": 1.03, "num_drafts": 400, "k": 3, "acceptance_per_pos": [0.025, 0.005, 0.0]}
    state = {"drafter": "/d", "window": win, "info": info, **judge("/d", win, info, s)}  # no benchmark: 1.1's 10 %
    assert state["state"] == "collapse" and "the drift report tells them apart" in state["why"], state["why"]
    ev = check_evaluation(server, state, 0, s)
    assert not ev.passed and ev.severity == dg.AssetCheckSeverity.ERROR
    assert judge("/d", {**win, "num_drafts": 99}, info, s)["state"] == "unknown"  # too few steps to say
    # the window: 1.092 at k = 2 against a benchmark whose first position accepted 55 %
    bench = {**info, "benchmark_acceptance_length": 1.77, "benchmark_k": 2, "benchmark_acceptance_per_pos": [0.55, 0.22]}
    low = {"acceptance_length": 1.092, "num_drafts": 173, "k": 2, "acceptance_per_pos": [0.08, 0.012]}
    got = judge("/d", {**low, "num_drafts": 173}, bench, DriftSettings(min_drafts=100))
    assert got["state"] == "collapse" and "against 55.0% on its benchmark (15% of it" in got["why"], got["why"]
    # k = 1 at 1.1 against a benchmark at k = 1 of 1.15: a weak drafter within its own figure, no collapse
    weak = {"acceptance_length": 1.1, "num_drafts": 400, "k": 1, "acceptance_per_pos": [0.1]}
    at_k1 = {**info, "benchmark_acceptance_length": 1.15, "benchmark_k": 1, "benchmark_acceptance_per_pos": [0.15]}
    assert judge("/d", weak, at_k1, s)["state"] == "fits"
    assert judge("/d", {**win, "acceptance_length": 1.4, "acceptance_per_pos": [0.3, 0.1, 0.0]},
                 {**info, "benchmark_acceptance_length": 1.9}, s)["state"] == "drift"


class FakeVllm:
    """A vLLM server's routes the report reads, on 127.0.0.1: /v1/models, /metrics, and chat completions answered with
    vLLM's per-request speculative figures (`accepted` drafts per step, 10 steps a request)."""

    def __init__(self, accepted: int):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.accepted, self.asked = accepted, 0

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: dict | str):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith("/v1/models"):
                    return self._send({"data": [{"id": "target"}]})
                if self.path.startswith("/metrics"):
                    return self._send("vllm:spec_decode_num_drafts_total 0\n")
                self.send_response(404)
                self.end_headers()

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                fake.asked += 1
                self._send(served_response([fake.accepted] * 10, k=2))

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _suspected_collapse(built, tmp_path, monkeypatch, accepted: int) -> tuple[dict, FakeVllm]:
    """A server suspected of a collapse (173 steps at 1.092 against a benchmark of 1.77), started by a restart command
    whose speculative config is the launch file beside its export, answering familiar prompts at `accepted` drafts a
    step: the report materialized on the shared graph, whose eval prompts are the probes'."""
    from eagle3_assets.eye.servers_file import SERVERS_ENV

    fake = FakeVllm(accepted)
    drafter = tmp_path / "exports" / "abc" / "vllm"
    launch = drafter.parent / "vllm-launch" / "speculative_config.vllm.json"
    launch.parent.mkdir(parents=True)
    launch.write_text(json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}))
    servers = tmp_path / "servers.yaml"
    servers.write_text(json.dumps({"servers": [{"name": "prod", "url": fake.url, "restart": [
        "vllm", "serve", "/t", "--speculative-config", "{speculative_config}"]}], "drift": {"probe_prompts": 4}}))
    monkeypatch.setenv(SERVERS_ENV, str(servers))
    built.materialize("drift_report", config={"drift_report": {"config": {
        "signal": "collapse", "server": "prod", "drafter": str(drafter), "live_acceptance_length": 1.092,
        "benchmark_acceptance_length": 1.77, "num_drafts": 173, "window_s": 120}}})
    return built.latest("drift_report"), fake


def test_a_new_language_accepted_near_nothing_is_a_drift_when_the_benchmarks_prompts_still_are(
        built, tmp_path, monkeypatch):
    """Issue 58, 6: a window of new-language traffic at 1.092 is a suspected collapse; the report sends the server
    prompts of the drafter's benchmark, which it accepts as benchmarked: the integration works, so it is a drift, and
    the retraining sensor answers it. The served method is read off the launch file the restart command names, never
    its template's placeholder."""
    from eagle3_assets.eye.servers_file import ServersFile
    from eagle3_assets.loop import on_drift as loop

    report, fake = _suspected_collapse(built, tmp_path, monkeypatch, accepted=1)
    fake.close()
    assert fake.asked == 4
    assert report["signal"] == "live" and report["suspected"] == "collapse", report
    assert report["kind"] == "drift, not collapse" and report["signals_fired"] == "live"
    assert report["report"].startswith("**Drift, not collapse**: prod served 173 speculative steps"), report["report"]
    assert report["probes"]["acceptance_length"] == 2.0 and report["probes"]["prompts"] == 4
    assert "each response's per-request metrics" in report["probes"]["read_from"]
    assert report["evidence"]["served_method"] == "eagle3" and "rendered for" in report["evidence"]["served_from"]
    parsed = ServersFile.model_validate({"servers": [{"name": "prod", "url": "http://127.0.0.1:1"}]})
    rec = built.instance.fetch_materializations(dg.AssetKey("drift_report"), limit=1).records[0]
    got = loop.build(parsed)(dg.build_sensor_context(instance=built.instance, cursor=json.dumps(
        {"after": rec.storage_id - 1})))
    assert [r.tags[loop.REPORT_TAG] for r in got.run_requests] == [str(rec.storage_id)]


def test_a_server_that_fails_the_benchmarks_own_prompts_too_is_a_collapse(built, tmp_path, monkeypatch):
    report, fake = _suspected_collapse(built, tmp_path, monkeypatch, accepted=0)
    fake.close()
    assert report["signal"] == "collapse" and report["kind"] == "collapse, not drift"
    assert report["report"].startswith("**Collapse, not drift**: prod served 173 speculative steps")
    assert "familiar prompts fail too" in report["report"] and report["probes_acceptance_length"] == 1.0


def test_a_collapse_report_names_the_fault_in_the_config_the_server_runs(built, tmp_path, monkeypatch):
    """A server started with EAGLE (not EAGLE-3) is a collapse whatever the probes could say (this one does not even
    answer them): the report says so with the launch as evidence, and locates nothing in the traffic."""
    from eagle3_assets.eye.servers_file import SERVERS_ENV

    servers = tmp_path / "servers.yaml"
    servers.write_text("servers:\n  - name: prod\n    url: http://127.0.0.1:1\n    restart: [vllm, serve, /t, "
                       "--speculative-config, '{\"method\": \"eagle\", \"model\": \"/d\"}']\n")
    monkeypatch.setenv(SERVERS_ENV, str(servers))
    built.materialize("drift_report", config={"drift_report": {"config": {
        "signal": "collapse", "server": "prod", "drafter": "/d", "live_acceptance_length": 1.02, "num_drafts": 400,
        "window_s": 60}}})
    meta = built.latest("drift_report")
    assert meta["signals_fired"] == "collapse" and meta["kind"] == "collapse, not drift"
    assert meta["evidence"]["served_method"] == "eagle" and meta["causes_found"] == 1
    assert "did not answer the probes" in meta["probes"]["skipped"]
    report = meta["report"]
    assert report.startswith("**Collapse, not drift**: prod served 400 speculative steps")
    assert "Cause found: the server was started with speculative method 'eagle', not EAGLE-3" in report
    assert "**Where**" not in report  # nothing to locate in the traffic


def test_a_collapse_starts_no_retraining():
    from eagle3_assets.eye.servers_file import ServersFile
    from eagle3_assets.loop import on_drift as loop

    parsed = ServersFile.model_validate({"servers": [{"name": "a", "url": "http://127.0.0.1:1", "engine": "vllm"}]})
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization("drift_report", metadata={
            "server": "a", "signal": "collapse"}))
        got = loop.build(parsed)(dg.build_sensor_context(instance=instance))
        assert not got.run_requests and "is a collapse on a, not drift: not retrained" in got.skip_reason.skip_message


def test_the_live_sensor_reports_a_collapse_within_one_window_without_replaying_the_traffic(monkeypatch):
    from eagle3_assets.eye import drift
    from eagle3_assets.eye.servers_file import ServersFile

    monkeypatch.setenv("EAGLE3_TRAFFIC_LOGS", "/nonexistent/*.jsonl")  # a drift would replay today's traffic
    parsed = ServersFile.model_validate({"servers": [{"name": "prod", "url": "http://127.0.0.1:1", "drafter": "/d"}],
                                         "drift": {"window_s": 60, "min_drafts": 100}})
    sensor = next(s for s in drift.build(parsed)[0] if s.name == "live_drift_sensor")
    with dg.instance_for_test() as instance:
        _observe(instance, "/d", 1.02, 150)
        _observe(instance, "/d", 1.04, 150)
        got = sensor(dg.build_sensor_context(instance=instance))
        (req,) = got.run_requests
        config = req.run_config["ops"]["drift_report"]["config"]
        assert config["signal"] == "collapse" and req.tags[drift.DRIFT_TAG] == "collapse:prod"
        # today's traffic read (its kinds as production served them tell a drift), nothing replayed
        assert sorted(k.to_user_string() for k in req.asset_selection) == ["drift_report", "traffic"]
        (check,) = got.asset_events
        assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
        again = sensor(dg.build_sensor_context(instance=instance, cursor=got.cursor))
        assert not again.run_requests  # a lasting collapse is not a report a tick


def _live_sensor(**server):
    """The live drift sensor of one server `prod` held to a benchmark of 2.0, judged over 60 s windows of 100 steps."""
    from eagle3_assets.eye import drift
    from eagle3_assets.eye.servers_file import ServersFile

    parsed = ServersFile.model_validate({"servers": [{"name": "prod", "url": "http://127.0.0.1:1",
                                                      "benchmark_acceptance_length": 2.0, **server}],
                                         "drift": {"window_s": 60, "min_drafts": 100, "locate": False}})
    return next(s for s in drift.build(parsed)[0] if s.name == "live_drift_sensor")


def test_a_drift_whose_report_run_was_canceled_is_reported_again_once_a_window():
    """A daemon stopped mid-report (its run canceled) leaves a lasting drift unreported: the live sensor reports it
    again, but not before a window has passed since it asked (a report that keeps failing is not asked for a tick)."""
    from dagster._core.test_utils import create_run_for_test  # a run record as the daemon would have left it

    from eagle3_assets.eye import drift

    sensor = _live_sensor(drafter="/d")
    with dg.instance_for_test() as instance:
        _observe(instance, "/d", 1.4, 150)
        got = sensor(dg.build_sensor_context(instance=instance))
        (req,), cursor = got.run_requests, json.loads(got.cursor)
        assert req.run_config["ops"]["drift_report"]["config"]["signal"] == "live"
        run = create_run_for_test(instance, job_name="report_drift", tags={drift.RUN_KEY_TAG: req.run_key})
        instance.report_run_canceled(run, message="the daemon stopped")
        assert not sensor(dg.build_sensor_context(instance=instance, cursor=json.dumps(cursor))).run_requests
        cursor["prod"]["reported"] -= 61  # a window later
        (again,) = sensor(dg.build_sensor_context(instance=instance, cursor=json.dumps(cursor))).run_requests
        assert again.run_config["ops"]["drift_report"]["config"]["signal"] == "live"
        create_run_for_test(instance, job_name="report_drift", tags={drift.RUN_KEY_TAG: again.run_key},
                            status=dg.DagsterRunStatus.SUCCESS)
        cursor["prod"].update(report_key=again.run_key, reported=cursor["prod"]["reported"] - 61)
        assert not sensor(dg.build_sensor_context(instance=instance, cursor=json.dumps(cursor))).run_requests  # made


def test_a_drift_on_the_drafter_rolled_out_is_reported_though_the_one_before_had_drifted_too():
    """The old drafter drifted and was reported; the rollout's first windows of the new one are too thin to judge;
    then the new drafter drifts too: that is its own drift, reported, not the old one lasting (the loop's second turn
    stalled on it: no report, no retraining)."""
    sensor = _live_sensor()
    with dg.instance_for_test() as instance:
        _observe(instance, "/old", 1.4, 150)
        got = sensor(dg.build_sensor_context(instance=instance))
        (old,) = got.run_requests
        assert old.run_config["ops"]["drift_report"]["config"]["drafter"] == "/old"
        _observe(instance, "/new", 1.3, 40)  # the rollout: a thin window, not judged
        thin = sensor(dg.build_sensor_context(instance=instance, cursor=got.cursor))
        assert not thin.run_requests and json.loads(thin.cursor)["prod"]["state"] == "unknown"
        _observe(instance, "/new", 1.3, 150)
        (new,) = sensor(dg.build_sensor_context(instance=instance, cursor=thin.cursor)).run_requests
        assert new.run_config["ops"]["drift_report"]["config"]["drafter"] == "/new"


def test_a_stopped_daemons_runs_are_neither_launched_nor_retried_by_the_next():
    """A story's daemon stopped with its run workers: the run the stop killed fails marked for retry, and the next
    daemon on the instance would retry it (CI: a drift report on the loop's server, retried in the collapse test,
    started a retraining there that took the CPU from it). Its unfinished runs are canceled, its failed ones not
    retried; a run already retried, or one no sensor started, is left as it is."""
    from dagster._core.test_utils import create_run_for_test

    from eagle3_assets.story.daemon import WILL_RETRY_TAG, settle_runs

    sensor = {"dagster/sensor_name": "live_drift_sensor"}
    with dg.instance_for_test() as instance:
        t0 = time.time() - 1
        running = create_run_for_test(instance, job_name="report_drift", tags=sensor,
                                     status=dg.DagsterRunStatus.STARTED)
        killed = create_run_for_test(instance, job_name="report_drift", tags={**sensor, WILL_RETRY_TAG: "true"},
                                     status=dg.DagsterRunStatus.FAILURE)
        retried = create_run_for_test(instance, job_name="report_drift", status=dg.DagsterRunStatus.FAILURE, tags={
            **sensor, WILL_RETRY_TAG: "true", "dagster/auto_retry_run_id": "x"})
        by_hand = create_run_for_test(instance, job_name="retrain_on_traffic", tags={WILL_RETRY_TAG: "true"},
                                      status=dg.DagsterRunStatus.FAILURE)
        # failed, its retry not yet decided (no tag: the retry daemon would decide from the failure)
        untagged = create_run_for_test(instance, job_name="report_drift", tags=sensor,
                                       status=dg.DagsterRunStatus.FAILURE)
        said = []
        settle_runs(instance, t0, said.append)
        get = instance.get_run_by_id
        assert get(running.run_id).status == dg.DagsterRunStatus.CANCELED
        assert get(killed.run_id).tags[WILL_RETRY_TAG] == get(untagged.run_id).tags[WILL_RETRY_TAG] == "false"
        assert get(retried.run_id).tags[WILL_RETRY_TAG] == get(by_hand.run_id).tags[WILL_RETRY_TAG] == "true"
        assert len(said) == 3 and sum("not retried" in line for line in said) == 2


def test_a_daemon_is_stopped_only_once_its_run_workers_have_ended(tmp_path):
    """The daemon's process group holds its run workers: one still writing its run's last events after the daemon
    itself exited would race settle_runs, so stop_daemon waits for the whole group, not the daemon alone."""
    import subprocess
    import sys

    from eagle3_assets.story.daemon import stop_daemon

    done = tmp_path / "worker-ended"
    worker = ("import signal, sys, time\n"
              "def last_events(*_):\n"
              "    time.sleep(1.5)\n"  # a run worker writing its failure after SIGTERM
              f"    open({str(done)!r}, 'w').write('done')\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, last_events)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    daemon = subprocess.Popen(["bash", "-c", f"{sys.executable} -c \"$0\" & sleep 60", worker],
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert daemon.stdout.readline().strip() == "ready"
    stop_daemon(daemon)
    assert done.read_text() == "done"


def test_a_retraining_names_the_drift_report_and_server_it_answers():
    from eagle3_assets.eye.servers_file import ServersFile
    from eagle3_assets.loop import on_drift as loop

    parsed = ServersFile.model_validate({"servers": [{"name": "a", "url": "http://127.0.0.1:1", "engine": "vllm"}]})
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization("drift_report", metadata={
            "server": "a", "signal": "live"}))
        rec = instance.fetch_materializations(dg.AssetKey("drift_report"), limit=1).records[0]
        (req,) = loop.build(parsed)(dg.build_sensor_context(instance=instance)).run_requests
        assert req.tags == {loop.RETRAIN_TAG: "vllm", loop.REPORT_TAG: str(rec.storage_id), loop.SERVER_TAG: "a"}


def test_the_acceptance_production_served_locates_the_fall_per_request_without_a_replay(drifted_day, monkeypatch):
    """The day's traffic holds what vLLM served each request: the report names the new kind from those figures
    alone, cut by the gateway field the team named too, and the live sensor's report run asks no replay of the host."""
    from eagle3_assets.eye import drift
    from eagle3_assets.eye.servers_file import ServersFile

    built, day = drifted_day
    traffic = built.latest("traffic", day)
    assert traffic["requests_with_served_figures"] == 8 and traffic["requests_served"] == 8
    assert traffic["served_acceptance_length"] == pytest.approx(1 + (4 * 40 + 4 * 4) / (4 * 20 + 4 * 20))
    by = {(g["by"], g["value"]): g for g in traffic["served_groups"]}
    assert by[("kind", "other-language")]["acceptance_length"] == pytest.approx(1.2)
    assert traffic["served_acceptance_length_other_language"] == pytest.approx(1.2)  # plotted day by day
    assert by[("tenant", "fr-team")]["requests"] == 4 and by[("tenant", "en-team")]["acceptance_length"] == 3.0

    runs_before = len(built.instance.get_runs())
    built.materialize("drift_report", config={"drift_report": {"config": {
        "signal": "live", "server": "prod", "live_acceptance_length": 1.9, "benchmark_acceptance_length": 2.6,
        "benchmark_from": "serving_benchmark", "num_drafts": 400, "window_s": 60, "traffic_day": day}}})
    report = built.latest("drift_report")
    assert report["where_served"] == "kind=other-language" and report["where_served_acceptance_length"] == 1.2
    assert "tenant `fr-team` 1.200" in report["report"]
    assert len(built.instance.get_runs()) == runs_before + 1  # the report's own run: nothing replayed

    monkeypatch.setenv("EAGLE3_TRAFFIC_LOGS", "/gateway/*.jsonl")
    parsed = ServersFile.model_validate({"servers": [{"name": "prod", "url": "http://127.0.0.1:1", "drafter": "/d"}]})
    state = {"state": "drift", "drafter": "/d", "window": {"acceptance_length": 1.9, "num_drafts": 400},
             "info": {"benchmark_acceptance_length": 2.6, "benchmark_from": "serving_benchmark"}}
    for locate, asked in [("auto", ["drift_report", "traffic"]), ("both", ["drift_report", "traffic", "traffic_acceptance"]),
                          ("replay", ["drift_report", "traffic", "traffic_acceptance"])]:
        parsed.drift.locate_from = locate
        req = drift.report_request(built.instance, parsed.servers[0], state, parsed.drift, time.time())
        assert sorted(k.to_user_string() for k in req.asset_selection) == asked, locate


# ---- issue 58, 7: a drift report must not starve the production it reports on ----------------------------------
def test_one_report_of_a_server_at_a_time():
    """A report run on the server still queued or running: the sensor asks for none more (two would replay and probe
    side by side); once it has ended, the drift that lasts is reported."""
    from dagster._core.test_utils import create_run_for_test

    from eagle3_assets.eye import drift

    sensor = _live_sensor(drafter="/d")
    with dg.instance_for_test() as instance:
        _observe(instance, "/d", 1.4, 150)
        queued = create_run_for_test(instance, job_name="report_drift", status=dg.DagsterRunStatus.STARTED,
                                     tags={drift.REPORT_ON_TAG: "prod", drift.DRIFT_TAG: "live:prod"})
        got = sensor(dg.build_sensor_context(instance=instance))
        assert not got.run_requests
        instance.report_run_canceled(queued, message="ended")
        (req,) = sensor(dg.build_sensor_context(instance=instance, cursor=got.cursor)).run_requests
        assert req.tags[drift.REPORT_ON_TAG] == "prod"
    limits = yaml.safe_load((Path(__file__).parents[2] / "dagster_home" / "dagster.yaml").read_text())
    assert {"key": drift.REPORT_ON_TAG, "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in \
        limits["concurrency"]["runs"]["tag_concurrency_limits"]  # the queue holds it too


def test_a_live_report_that_waited_past_its_window_for_a_server_that_moved_on_is_dropped(tmp_path, monkeypatch):
    """A report run queued before a daemon restart runs 40 minutes late: the server fits again, so it reports nothing
    and says why in its log; one whose server still drifts is made, however late."""
    from eagle3_assets.eye import drift
    from eagle3_assets.eye.drift_report import make_drift_report
    from eagle3_assets.eye.servers_file import SERVERS_ENV
    from eagle3_assets.hosts import LocalGpuHost

    servers = tmp_path / "servers.yaml"
    servers.write_text(json.dumps({"servers": [{"name": "prod", "url": "http://127.0.0.1:1", "drafter": "/d",
                                                "benchmark_acceptance_length": 2.0}],
                                   "drift": {"window_s": 60, "min_drafts": 100, "locate": False}}))
    monkeypatch.setenv(SERVERS_ENV, str(servers))
    config = {"signal": "live", "server": "prod", "drafter": "/d", "live_acceptance_length": 1.4,
              "benchmark_acceptance_length": 2.0, "num_drafts": 150, "window_s": 60,
              "observed_at": time.time() - 2400}

    def report(instance):
        res = dg.materialize([make_drift_report([])], instance=instance, tags={drift.DRIFT_TAG: "live:prod"},
                             resources={"gpu_host": LocalGpuHost(workdir=str(tmp_path / "work"))},
                             run_config={"ops": {"drift_report": {"config": config}}})
        logs = " ".join(str(e.user_message) for e in instance.all_logs(res.run_id))
        return res.success, instance.get_latest_materialization_event(dg.AssetKey("drift_report")), logs

    with dg.instance_for_test() as instance:
        _observe(instance, "/d", 1.95, 150)  # fits now
        ok, made, logs = report(instance)
        assert ok and made is None, "a stale report was made"
        assert "drift report dropped: the window it reports on ended 40 min ago" in logs and "fits now" in logs
    with dg.instance_for_test() as instance:
        _observe(instance, "/d", 1.4, 150)  # still drifting: late, but still true
        ok, made, _ = report(instance)
        assert ok and made is not None


def test_auto_locates_with_the_figures_production_served_when_the_gateway_logs_them(tmp_path, monkeypatch):
    """No traffic day read yet: the gateway's newest log says whether it logs vLLM's per-request figures; with them
    the report locates the drift from what production served, and replays nothing on the host beside it."""
    from eagle3_assets.eye import drift

    settings = DriftSettings()
    with_figures, without = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "Bonjour"}]}
    with_figures.write_text("".join(json.dumps({"timestamp": time.time(), "body": body,
                                                "response": served_response([1, 0])}) + "\n" for _ in range(3)))
    without.write_text(json.dumps({"timestamp": time.time(), "body": body}) + "\n")
    with dg.instance_for_test() as instance:
        monkeypatch.setenv("EAGLE3_TRAFFIC_LOGS", str(with_figures))
        assert drift.locate_from(instance, settings) == "served"
        monkeypatch.setenv("EAGLE3_TRAFFIC_LOGS", str(without))
        assert drift.locate_from(instance, settings) == "replay"


def test_the_replay_yields_the_cpu_and_keeps_to_its_budget(drifted_day, tmp_path):
    """Run as production's neighbour would run it (a worker process on the host): niced, and past its budget it
    replays no more traffic, reporting on the prompts it did."""
    from eagle3_assets.hosts import LocalGpuHost

    built, day = drifted_day
    replay = {"limit": 8, "eval_limit": 2, "max_new_tokens": 8, "min_group": 1, "lowest": 1, "batch_size": 2,
              "budget_s": 0.001}
    built.materialize("traffic_acceptance", partition=day, host=LocalGpuHost(workdir=str(built.workdir)),
                      config={"traffic_acceptance": {"config": replay}})
    meta = built.latest("traffic_acceptance", day)
    assert meta["prompts"] == 2, meta["prompts"]  # one batch, then the budget was spent
    assert meta["niceness"] >= min(19, 10 + os.nice(0))  # the worker process's own, 10 above its parent
