"""The serving eye against a real production server: vLLM (CPU build) serving a drafter trained on the shipped chat
prompts (the shipped base drafter, finetuned by the graph), benchmarked by serving_benchmark, traffic sent to it by
a bounded load generator on 127.0.0.1 that writes the gateway's request log (gateway.py), and the real Dagster
daemon running the sensors. The traffic moves to languages the drafter never saw: the live and the offline drift
signals fire and the report names the new kind of prompt; live acceptance through a stop and a restart."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.scheduler.instigation import InstigatorType

from conftest import Graph
from daemon_harness import ROOT, start_daemon, stop_daemon
from eagle3_assets.assets.speculation_schedule import schedule_for
from eagle3_assets.common import load_mix, spec_counters
from eagle3_assets.eye.drift import DRIFT_TAG, LIVE_CHECK
from eagle3_assets.eye.live_acceptance import asset_key
from eagle3_assets.loop import production as record
from eagle3_assets.sources.redact import KINDS
from eagle3_assets.story import serving_loop
from eagle3_assets.story.daemon import settle_runs
from eagle3_assets.story.gateway import OTHER_LANGUAGES, Gateway, chat_prompts
from eagle3_assets.worker.engines import vllm
from eagle3_assets.worker.engines.server import EngineServer, free_port

pytestmark = pytest.mark.slow
PROMPTS = ["Write a haiku about the sea.", "Explain what a hash map is.", "List three prime numbers.",
           "What is the capital of France?", "Give me a tip for learning to cook.", "Describe a cat in one line."]
# The shipped base drafter, finetuned a little on the graph's own conversations: a drafter of the shipped chat prompts.
FINETUNE = {"init_from": "shipped:smollm2-135m-instruct", "epochs": 1, "lr": 1e-5, "ttt_steps": 3, "row_tokens": 48,
            "rows_per_batch": 1, "warmup_ratio": 0.0, "run_name": "production"}
# The benchmark production is held to: the eval prompts at the length and k the server runs, float32 as it runs.
FIGURES = {"limit": 8, "max_new_tokens": 64}
BENCH = {**FIGURES, "concurrencies": [1], "baseline": False, "max_model_len": 1024, "dtype": "float32",
         "extra_args": ["--enforce-eager"]}


def _server(target: str, drafter: str, port: int, log: Path) -> EngineServer:
    argv = vllm.server_command(sys.executable, target, port, drafter=drafter, k=3, dtype="float32",
                               max_model_len=1024, seed=0,
                               extra=["--enforce-eager", "--per-request-spec-decode-metrics", "summary"])
    return EngineServer("production", argv, port, log, env=vllm.SERVER_ENV)


def _load(url: str, n: int, max_tokens: int = 24) -> None:
    """A bounded load generator: n completions, one at a time, to the server on 127.0.0.1."""
    for i in range(n):
        body = json.dumps({"model": "target", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200


def _counters(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {**spec_counters.vllm_counters(text), "load": spec_counters.vllm_load(text)}


@dataclass
class Production:
    graph: Graph
    server: EngineServer
    drafter: str  # the vLLM export it serves
    root: Path
    home: Path  # the instance's DAGSTER_HOME: the daemon's too


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    """A graph of its own (an instance on disk, as a team's), its drafter exported, measured offline and benchmarked
    in vLLM, then served by vLLM as a production server would."""
    root = tmp_path_factory.mktemp("production")
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster_home" / "dagster.yaml").read_text())
    g = Graph(dg.DagsterInstance.from_config(str(home)), root / "host_work")
    g.materialize("target_model", "prompts", "synthetic_prompts", "conversations", "vocab_mapping")
    for key in g.instance.get_dynamic_partitions("hidden_state_shards"):
        g.materialize("hidden_state_shards", partition=key)
    g.materialize("eagle3_drafter", "drafter_export", "offline_acceptance",
                  config={"eagle3_drafter": {"config": FINETUNE}, "offline_acceptance": {"config": FIGURES}})
    export = g.latest("drafter_export")["vllm_path"]
    srv = _server(g.latest("target_model")["path"], export, free_port(), root / "server.log")
    # the production server starts beside the benchmark's (CI's time: ~25 s): the eye reads the benchmark's
    # acceptance, which the shared cores do not change, not its tokens/s
    with srv:
        g.materialize("serving_benchmark", partition="vllm", config={"serving_benchmark": {"config": BENCH}})
        srv.wait_ready(600)
        yield Production(g, srv, export, root, home)


class Daemon:
    """The real dagster-daemon on the production instance, with the serving eye's settings in its environment."""

    def __init__(self, p: Production, servers: dict, **env: str):
        (p.root / "servers.yaml").write_text(yaml.safe_dump(servers))
        self.env = {**os.environ, "DAGSTER_HOME": str(p.home), "EAGLE3_SERVERS": str(p.root / "servers.yaml"),
                    "EAGLE3_HOST_WORKDIR": str(p.graph.workdir), **env}
        self.t0 = time.time()
        self.proc = start_daemon(self.env, p.root / "daemon.log")
        self.instance = p.graph.instance

    def observations(self, name: str, since: float = 0) -> list[dict]:
        recs = self.instance.fetch_observations(asset_key(name), limit=1000).records
        out = [{"t": r.timestamp, **{k: v.value for k, v in r.event_log_entry.asset_observation.metadata.items()}}
               for r in recs if r.timestamp >= since]
        return out[::-1]  # oldest first

    def checks(self, name: str, since: float) -> list[dict]:
        """The live check's evaluations since `since`, oldest first."""
        recs = self.instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(asset_key(name), LIVE_CHECK), limit=200)
        out = [{"t": r.create_timestamp, "passed": r.evaluation.passed,
                **{k: v.value for k, v in r.evaluation.metadata.items()}}
               for r in recs if r.evaluation is not None and r.create_timestamp >= since]
        return sorted(out, key=lambda c: c["t"])

    def runs(self, tag: str) -> list:
        return self.instance.get_runs(dg.RunsFilter(tags={DRIFT_TAG: tag}))

    def wait(self, what: str, fetch, pred, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = fetch()
            if pred(got):
                return got
            time.sleep(2)
        raise AssertionError(f"timed out waiting for {what}; last seen: {str(fetch())[-1500:]}")

    def cli(self, *argv: str) -> str:
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def stop(self):
        stop_daemon(self.proc)
        settle_runs(self.instance, self.t0)  # nothing it left half-run is launched or retried by the next test's


def _cursor(instance, sensor: str) -> dict:
    """The sensor's cursor as the daemon last stored it ({} before its first tick)."""
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.name == sensor and state.instigator_data and state.instigator_data.cursor:
            raw = json.loads(state.instigator_data.cursor)
            return {"after": raw} if isinstance(raw, int) else raw
    return {}


def _finished(runs) -> bool:
    return bool(runs) and all(r.is_finished for r in runs)


def _report(instance, signal: str) -> dict:
    for rec in instance.fetch_materializations(dg.AssetKey("drift_report"), limit=20).records:
        meta = {k: v.value for k, v in rec.event_log_entry.asset_materialization.metadata.items()}
        if meta["signal"] == signal:
            return {"t": rec.timestamp, "storage_id": rec.storage_id, **meta}
    raise AssertionError(f"no {signal} drift report")


def test_traffic_in_a_new_language_fires_both_drift_signals_and_the_report_names_it(production):
    p = production
    log = p.root / "gateway" / "requests.jsonl"
    log.parent.mkdir()
    drift = {"window_s": 45, "min_drafts": 100, "live_drop": 0.10, "offline_drop": 0.10, "replay_limit": 24,
             "offline_interval_s": 15}
    daemon = Daemon(p, {"interval_s": 5, "drift": drift, "servers": [
        {"name": "prod", "url": p.server.base_url, "engine": "vllm", "drafter": p.drafter}]},
        EAGLE3_TRAFFIC_LOGS=str(log))
    gw = Gateway(p.server.base_url, log)
    bench = p.graph.latest("serving_benchmark", "vllm")["acceptance_length"]
    foreign = iter(OTHER_LANGUAGES)
    try:
        # 1. The traffic it was trained for: the live check holds against its benchmark, nothing is reported.
        t0 = time.time()  # the load starts after the sensor's first read, which counts all since the server started
        daemon.wait("the sensor's first read", lambda: daemon.observations("prod", t0), lambda o: len(o) >= 1, 180)
        for text in chat_prompts(6):
            gw.send(text)
        fits = daemon.wait("the live check to judge the chat traffic", lambda: daemon.checks("prod", t0),
                           lambda cs: any(c["state"] != "unknown" for c in cs), 120)
        judged = next(c for c in fits if c["state"] != "unknown")
        assert judged["state"] == "fits" and judged["passed"], judged
        assert judged["benchmark_acceptance_length"] == pytest.approx(bench)
        assert not daemon.runs("live:prod")
        before = [o for o in daemon.observations("prod", t0) if o.get("num_drafts")]
        assert all(o["checkpoint"] == p.graph.data_version("eagle3_drafter") for o in before)
        assert all(o["benchmark_acceptance_length"] == pytest.approx(bench) for o in before)

        # 2. The traffic moves to languages it never saw (the first request carries an e-mail address): the live
        # signal fires, and its report says where from what production served each request (the gateway logs
        # vLLM's per-request figures): no replay beside production (drift.locate_from auto).
        changed, sent = time.time(), gw.sent
        gw.send(next(foreign) + " Écris-moi à jeanne.martin@exemple-mail.fr.")
        for text in foreign:
            if daemon.runs("live:prod") or gw.sent - sent >= 20:
                break
            gw.send(text)
        # the last requests may land after the sensor's tick: the next tick (or two) judges them
        daemon.wait(f"a live drift report after {gw.sent - sent} requests of the new kind",
                    lambda: daemon.runs("live:prod"), bool, 60)
        runs = daemon.wait("the live drift report run", lambda: daemon.runs("live:prod"), _finished, 900)
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [r.status for r in runs]
        live = _report(p.graph.instance, "live")
        print(f"\nlive drift: requested after {gw.sent - sent} requests of the new kind; report {live['t'] - changed:.0f} "
              f"s after the change; live {live['live_acceptance_length']} vs benchmark "
              f"{live['benchmark_acceptance_length']}; fired {live['signals_fired']}")
        assert live["signals_fired"] == "live", live["report"]
        assert live["live_acceptance_length"] < bench * 0.9
        assert "traffic_acceptance_length" not in live, live["report"]  # nothing replayed beside production
        assert not [r for r in p.graph.instance.fetch_materializations(dg.AssetKey("traffic_acceptance"),
                                                                         limit=5).records if r.timestamp > changed]
        assert "**Load**" in live["report"] and live["mean_batch_in_window"] > 0, live["report"]  # whether it moved too
        # what vLLM served each request, logged with it by the gateway, names the kind
        print(f"served: {live['requests_served']} requests at {live['served_acceptance_length']} against "
              f"{live['served_reference']}; where {live['where_served']} at {live['where_served_acceptance_length']}")
        assert live["where_served"] == "kind=other-language", live["report"]
        assert live["where_served_acceptance_length"] < live["served_reference"] * 0.9
        traffic = p.graph.latest("traffic", live["traffic_day"])
        assert traffic["redacted_email"] == 1 and sum(traffic[f"redacted_{k}"] for k in KINDS) == 1
        assert "jeanne.martin@" not in json.dumps(live, default=str)

        # 3. The day goes on in the new languages; the day's traffic is read again (as a daily schedule would) and
        # the traffic drift sensor (off by default) replays it: the offline signal fires on its own.
        for text in foreign:
            gw.send(text)
        day = live["traffic_day"]
        daemon.cli("dagster", "asset", "materialize", "-m", "eagle3_assets.definitions", "--select", "traffic",
                   "--partition", day)
        daemon.cli("dagster", "sensor", "start", "traffic_drift_sensor", "-w", str(ROOT / "workspace.yaml"))
        daemon.wait("the offline drift report", lambda: daemon.runs(f"offline:{day}"),
                    lambda rs: len(rs) >= 2 and _finished(rs), 900)
        offline = _report(p.graph.instance, "offline")
        print(f"offline drift: traffic {offline['traffic_acceptance_length']} vs eval {offline['eval_acceptance_length']}"
              f" ({offline['offline_drop']:.1%} lower); where {offline['where']}")
        assert offline["signals_fired"] == "offline" and offline["where"] == "kind=other-language", offline["report"]
        assert offline["where_share_of_training"] < 0.05  # a kind the drafter never trained on

        # 4. Lineage per served drafter: its benchmark, its live figures over time, the reports against it.
        out = daemon.cli("eagle3-assets", "lineage", "--served")
        print(out)
        assert f"checkpoint {p.graph.data_version('eagle3_drafter')}" in out
        assert f"AL {bench:.3f}" in out and "live, last day:" in out
        assert "fired: live" in out and "fired: offline" in out
    finally:
        # a sensor's state lives in the instance: left on, it would replay the next tests' traffic days meanwhile
        subprocess.run(["dagster", "sensor", "stop", "traffic_drift_sensor", "-w", str(ROOT / "workspace.yaml")],
                       cwd=ROOT, env=daemon.env, capture_output=True, timeout=300, check=False)
        daemon.stop()


# Run before the loop's two turns (pytest keeps this order): it ends by stopping the module's production server,
# whose memory (~4 GiB) the promotion gate's three servers need beside prod-a and the canary to start together
# and be measured in turns, not one after another (slower, and noisier on a shared host).
def test_live_acceptance_from_a_real_server_through_load_a_stop_and_a_restart(production):
    p = production
    srv, drafter = p.server, p.drafter
    t0 = time.time()
    daemon = Daemon(p, {"interval_s": 5, "drift": {"locate": False}, "servers": [
        {"name": "prod", "url": srv.base_url, "engine": "vllm", "drafter": drafter}]})
    try:
        first = daemon.wait("the sensor's first read", lambda: daemon.observations("prod", t0), lambda o: len(o) >= 1,
                            180)
        assert first[0]["drafter"] == drafter and first[0]["drafter_from"] == "config"
        before, t_seq = _counters(srv.base_url), time.time()
        _load(srv.base_url, 6)
        seq_wall, after = time.time() - t_seq, _counters(srv.base_url)
        assert after["num_drafts"] > before["num_drafts"], "the load must make speculative steps"
        obs = daemon.wait("the load's drafts in the observations", lambda: daemon.observations("prod", t0),
                          lambda o: sum(x.get("num_drafts", 0) for x in o[1:]) >= after["num_drafts"]
                          - before["num_drafts"], 120)
        busy = [x for x in obs[1:] if x.get("num_drafts")]
        assert busy and all(x["status"] == "ok" for x in busy)
        for x in busy:  # each window as the server's own counters define it
            assert abs(x["acceptance_length"] - (1 + x["num_accepted_tokens"] / x["num_drafts"])) < 1e-3
            per_pos = json.loads(x["acceptance_per_pos"])
            assert len(per_pos) == 3 and all(0 <= q <= 1 for q in per_pos)
            assert 1 <= x["acceptance_length"] <= 4
        window = spec_counters.window(before, after)
        drafts = sum(x["num_drafts"] for x in busy)
        assert drafts == window["num_drafts"], "the windows add up to what the server counted, nothing twice"
        daemon.wait("an idle window once the load ends", lambda: daemon.observations("prod", t0),
                    lambda o: o[-1]["status"].startswith("idle"), 60)
        # the load each window served: the output tokens add up to the server's count, and one request at a time
        # never runs more than one at once on average
        made = after["load"]["generation_tokens"] - before["load"]["generation_tokens"]
        seen = daemon.observations("prod", t_seq)
        assert made > 0 and sum(x.get("generation_tokens", 0) for x in seen) == made
        seq_running_s = sum(x.get("mean_requests_running", 0) * x.get("window_s", 0) for x in seen)
        assert 0 < seq_running_s <= seq_wall * 1.05, (seq_running_s, seq_wall)
        # four at once: the windows see four running together (Little's law over the requests that finished)
        t_burst = time.time()
        burst = [threading.Thread(target=_load, args=(srv.base_url, 1, 48)) for _ in range(4)]
        for th in burst:
            th.start()
        for th in burst:
            th.join()
        wall = time.time() - t_burst
        obs = daemon.wait("the burst in the observations", lambda: daemon.observations("prod", t_burst),
                          lambda o: sum(x.get("requests_finished", 0) for x in o) >= 4, 60)
        running_s = sum(x.get("mean_requests_running", 0) * x.get("window_s", 0) for x in obs)
        assert running_s > 2 * wall, (running_s, wall)

        srv.stop()  # the server goes away: an observation says so, and the sensor goes on
        down = daemon.wait("an unreachable read", lambda: daemon.observations("prod", t0),
                           lambda o: o[-1]["status"].startswith("unreachable"), 60)
        assert "acceptance_length" not in down[-1]
        restarted = _server(p.graph.latest("target_model")["path"], drafter, srv.port, p.root / "server-2.log")
        with restarted:
            restarted.wait_ready(600)
            _load(restarted.base_url, 2)
            fresh = _counters(restarted.base_url)
            # a scrape may land between the restart and the load: the window from the restart on counts the load
            obs = daemon.wait("the restart seen as counters that went back, then the load counted",
                              lambda: daemon.observations("prod", t0), lambda o: _since_restart(o) > 0, 120)
            assert _since_restart(obs) <= fresh["num_drafts"], "the new window counts from the restart, not the past"
    finally:
        daemon.stop()


def _since_restart(obs: list[dict]) -> int:
    """Speculative steps counted from the first observation that saw the counters go back (0 before one)."""
    at = next((i for i, x in enumerate(obs) if x["status"].startswith("restarted")), None)
    return 0 if at is None else sum(int(x.get("num_drafts") or 0) for x in obs[at:])


def _retrain(**gate) -> dict:
    """The story's retraining, trimmed to what the assertions need (CI's time): two epochs, not three; the gate on
    8 prompts a set and 32 new tokens a reply (the challenger's gain on the traffic was 13-27 %, the margin 2 %); the
    challenger's schedule from the gate's own batches (source: gate), no sweep (test_load_curve.py sweeps)."""
    cfg = serving_loop.retrain_config()
    cfg["ops"]["challenger_drafter"]["config"].update(epochs=2)
    cfg["ops"]["promotion_gate"]["config"].update(limit=8, max_new_tokens=32, **gate)
    cfg["ops"]["challenger_schedule"]["config"] = {"source": "gate"}
    return cfg


def test_the_loop_retrains_on_the_new_traffic_promotes_through_the_gate_and_rolls_out(production):
    """The README's second story (eagle3_assets/story/serving_loop.py) on the production graph, with a canary
    beside its server that reads its drafters from its own copy of the exports: the drafter in production (promoted
    by hand) serves; the traffic moves to other languages; drift starts a retraining (retrain_on_drift_sensor,
    turned on as a team would), whose challenger wins the gate and is rolled out: prod-a serves it, and its live
    acceptance on prompts of the new kind that never entered the traffic rises; the canary, where nobody copied the
    new export, fails its health check and is rolled back, stopping the rollout there."""
    p = production
    work = p.root / "story"
    target, champion = p.graph.latest("target_model")["path"], p.drafter
    canary_root = p.root / "canary-models"  # the canary's own copy of the exports: the champion only
    shutil.copytree(Path(champion), canary_root / Path(champion).parent.name / Path(champion).name)
    port = free_port()
    canary = {"name": "canary", "url": f"http://127.0.0.1:{port}", "engine": "vllm", "drafter": champion,
              "restart": serving_loop.restart_command(work / "canary", port, target, "--drafter-root", str(canary_root)),
              "ready_timeout_s": 40}  # its rollback restart takes ~22 s; the canary waits this out
    try:
        story = serving_loop.run(p.home, work, name="prod-a", extra_servers=(canary,), workspace=ROOT / "workspace.yaml",
                                 cwd=ROOT, env={"EAGLE3_HOST_WORKDIR": str(p.graph.workdir)}, timeout_s=2400,
                                 retrain=_retrain())
        now = record.current(p.graph.instance, "vllm")
        gate = p.graph.latest("promotion_gate", "vllm")
        print(f"\ngate: {json.dumps(gate['figures'])}\nproduction: {now['decision']} {now['version'][:12]}\n"
              f"the loop's steps (s): {json.dumps(story.steps_s)}\nthe story's marks (s): {json.dumps(story.marks)}\n"
              f"live acceptance on prompts of the new kind kept out of the traffic: {story.before:.3f}, then {story.after}")
        retrainings = p.graph.instance.get_runs(dg.RunsFilter(tags={"eagle3/retrain": "vllm"}))
        assert len(retrainings) == 1, "one retraining per engine at a time"
        assert story.champion == champion
        assert now["decision"] == "promoted by the gate" and now["replaced"] == p.graph.data_version("eagle3_drafter")
        assert now["traffic_days"] and now["version"] == gate["challenger"]
        # the challenger's schedule was measured before its promotion, beside its export, where a rollout's
        # {speculative_config} and serving_benchmark find it
        sched = p.graph.latest("challenger_schedule", "vllm")
        assert sched["checkpoint"] == now["version"]
        assert (Path(now["export_path"]).parent / "vllm-launch" / "load_curve.json").is_file()
        assert schedule_for(p.graph.instance, "vllm", now["version"])[0]["schedule_text"] == sched["schedule_text"]
        # the speedups were weighed by the load prod-a served (one request at a time from the story's gateway)
        assert gate["load_mix_from"].startswith("the production's load mix, observed on prod-a"), gate["load_mix_from"]
        figs = gate["figures"]
        assert figs["challenger"]["traffic"]["acceptance_length"] > figs["champion"]["traffic"]["acceptance_length"]
        # the rollout: prod-a serves the challenger; the canary failed its health check and is back on the champion
        assert story.run_status == "FAILURE"
        assert "stopped at canary" in _failure(p.graph.instance, story.run_id)
        assert (work / "prod-a" / "drafter").read_text() == now["export_path"]
        assert (work / "canary" / "drafter").read_text().endswith(str(Path(champion).relative_to(
            Path(champion).parents[1])))
        assert _healthy(canary["url"])
        # the live acceptance on the new kind of traffic, before and after
        assert story.after is not None and story.after > story.before
    finally:
        serving_loop.stop_servers(work, ("prod-a", "canary"))


# The new language is learnt at 1 request at a time; at 4 both drafters draft k=3 on 2 shared cores, where 8 requests
# measure one drafter's tokens/s to +-40 % (CI saw 31.5 against 53.5 with equal settings): at half the weight that
# noise alone refused a challenger 40 % faster at 1.
MIX = {"1": 0.75, "4": 0.25}


def test_the_loops_second_turn_is_judged_against_the_first_promotion_and_retrains_again(production):
    """The loop's second turn on the same instance (`eagle3-assets serving-loop --kind it-pt`): the drafter the first
    turn promoted serves, judged against its gate figures; traffic in Italian and Portuguese (neither the shipped
    drafter nor the first retraining learned them) is reported as drift, retrained on, gated at a load mix given by
    hand (a quarter of the output at 4 requests at once), promoted and rolled out, and the live acceptance on held-out
    prompts of that kind rises."""
    p = production
    first = record.current(p.graph.instance, "vllm")
    if not first or first["decision"] != "promoted by the gate":
        pytest.skip("the loop's first turn (the test above) promoted nothing")
    work = p.root / "story-2"
    t0 = time.time()
    try:
        story = serving_loop.run(p.home, work, name="prod-a", kind="it-pt", workspace=ROOT / "workspace.yaml",
                                 cwd=ROOT, env={"EAGLE3_HOST_WORKDIR": str(p.graph.workdir)}, timeout_s=2400,
                                 retrain=_retrain(load_mix=MIX))
    finally:
        serving_loop.stop_servers(work, ("prod-a",))
    now = record.current(p.graph.instance, "vllm")
    # this turn's report, or one the eye made on the first promotion's drafter at the first turn's end (its probes)
    # that still stands: a lasting drift is not reported twice
    reports = [r for r in p.graph.instance.fetch_materializations(dg.AssetKey("drift_report"), limit=10).records
               if r.timestamp >= t0 or serving_loop.open_on(r, "prod-a", first)]
    assert reports, "no drift report in the second turn"
    report = {k: v.value for k, v in reports[-1].event_log_entry.asset_materialization.metadata.items()}
    gate = p.graph.latest("promotion_gate", "vllm")
    change = next(v for k, v in story.marks.items() if k.startswith("live acceptance on"))
    print(f"\nsecond turn: {report['report']}\ngate: {json.dumps(gate['figures'])}\nproduction: {now['decision']} "
          f"{now['version'][:12]} (replaced {now['replaced'][:12]})\nthe loop's steps (s): {json.dumps(story.steps_s)}"
          f"\nthe story's marks (s): {json.dumps(story.marks)}\nlive acceptance on held-out Italian and Portuguese: "
          f"{story.before:.3f}, then {story.after}; drift reported {story.marks['drift reported'] - change:.0f} s "
          f"after the change")
    assert story.champion == first["export_path"]
    # judged against the first turn's promotion: its checkpoint, the gate's figure for it
    assert report["checkpoint"] == first["version"] and "promotion_gate" in report["report"], report["report"]
    assert story.marks["drift reported"] - change < 180
    assert story.run_status == "SUCCESS", _failure(p.graph.instance, story.run_id)
    assert now["decision"] == "promoted by the gate" and now["replaced"] == first["version"]
    assert (work / "prod-a" / "drafter").read_text() == now["export_path"]
    assert story.after is not None and story.after > story.before
    # the gate weighed the speedups by the load mix given by hand, measured at each of its concurrencies
    assert gate["challenger"] == now["version"]
    assert gate["load_mix_from"] == "the load mix given: 75% at 1, 25% at 4", gate["load_mix_from"]
    # the challenger's schedule was chosen from those batches: at both concurrencies, its k against none
    sched = p.graph.latest("challenger_schedule", "vllm")
    assert sched["checkpoint"] == now["version"] and sched["grid"] == [1, 4] and sched["ks"] == [0, 3]
    assert sched["measured_by"].startswith("the promotion gate's batches"), sched
    for label in ("champion", "challenger"):
        traffic, base = gate["figures"][label]["traffic"], gate["figures"]["baseline"]["traffic"]
        tok, base_tok = ({int(c): v for c, v in f["tokens_per_s_by_concurrency"].items()} for f in (traffic, base))
        assert set(tok) == {1, 4} and all(v > 0 for v in tok.values())
        # the speedup at each concurrency is the median of its batches' (served in turn beside the target alone's),
        # and the mix weighs those: the tokens/s they imply, the baseline's times each
        by_c = {int(c): v for c, v in traffic["speedup_by_concurrency"].items()}
        assert set(by_c) == {1, 4} and by_c[1] == pytest.approx(traffic["speedup_at_first_concurrency"], abs=1e-4)
        mix = {int(c): w for c, w in MIX.items()}
        implied = {c: base_tok[c] * by_c[c] for c in by_c}
        assert traffic["speedup"] == pytest.approx(load_mix.speedup(mix, implied, base_tok), abs=1e-3)
        assert gate[f"{label}_traffic_speedup_at_4"] == pytest.approx(by_c[4], abs=1e-4)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _failure(instance, run_id: str) -> str:
    """Why the run failed: its steps' failures, and the blocking checks that failed (the gate refusing)."""
    out = []
    for e in instance.all_logs(run_id):
        ev = e.dagster_event
        if ev and ev.is_step_failure and ev.step_failure_data.user_failure_data:
            out.append(ev.step_failure_data.user_failure_data.description or "")
        elif ev and ev.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION and not ev.event_specific_data.passed:
            out.append(f"check {ev.event_specific_data.check_name} failed: {ev.event_specific_data.description}")
    return "\n".join(out)


def test_a_planted_collapse_is_reported_as_a_collapse_within_one_window_and_starts_no_retraining(production):
    """The production drafter's export copied with its aux layers shifted (vLLM captures layers 1-3 of the target, not
    those it was trained on: acceptance near 1, as in the seed story) and served by vLLM; with the retraining sensor
    on, the real daemon's live signal reports a collapse, not drift, naming the evidence, and nothing is retrained."""
    p = production
    src = Path(p.drafter)
    broken = p.root / "broken" / src.parent.name / src.name  # the export's directory name: tied to its checkpoint
    shutil.copytree(src, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    srv = _server(p.graph.latest("target_model")["path"], str(broken), free_port(), p.root / "broken.log")
    window = 45
    with srv:
        srv.wait_ready(600)
        daemon = Daemon(p, {"interval_s": 5, "drift": {"window_s": window, "min_drafts": 100}, "servers": [
            {"name": "broken", "url": srv.base_url, "engine": "vllm", "drafter": str(broken)}]})
        try:
            # the reports of this module's earlier tests are answered already: the sensor reads from the newest on
            recs = p.graph.instance.fetch_materializations(dg.AssetKey("drift_report"), limit=1).records
            if recs:
                daemon.cli("dagster", "sensor", "cursor", "retrain_on_drift_sensor", "--set",
                           json.dumps({"after": recs[0].storage_id}), "-w", str(ROOT / "workspace.yaml"))
            daemon.cli("dagster", "sensor", "start", "retrain_on_drift_sensor", "-w", str(ROOT / "workspace.yaml"))
            t0 = time.time()
            daemon.wait("the sensor's first read", lambda: daemon.observations("broken", t0), lambda o: len(o) >= 1, 180)
            t_load = time.time()
            while not daemon.runs("collapse:broken") and time.time() - t_load < 300:
                _load(srv.base_url, 4)
            runs = daemon.wait("the collapse report run", lambda: daemon.runs("collapse:broken"), _finished, 300)
            assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), [r.status for r in runs]
            report = _report(p.graph.instance, "collapse")
            checks = daemon.checks("broken", t0)
            print(f"\ncollapse: live {report['live_acceptance_length']} reported {report['t'] - t_load:.0f} s after "
                  f"the load began (window {window} s); evidence {report['evidence']}")
            assert report["t"] - t_load < window + 90  # one window, the sensor's tick and the report run
            assert report["live_acceptance_length"] <= 1.1 and report["signals_fired"] == "collapse"
            assert report["report"].startswith("**Collapse, not drift**: broken served")
            assert report["checkpoint"] == p.graph.data_version("eagle3_drafter")
            assert any(c["state"] == "collapse" and not c["passed"] for c in checks)
            # the retraining sensor (a tick every 30 s) reads the report and skips it: its cursor moves past the report
            seen = daemon.wait("the retraining sensor to read the collapse report", lambda: _cursor(
                p.graph.instance, "retrain_on_drift_sensor").get("after", 0), lambda a: a >= report["storage_id"], 150)
            assert seen >= report["storage_id"]
            # no retraining answers a report on the broken server (each names the report and server it answers; one
            # an earlier test's report started on another server is not this server's)
            since = p.graph.instance.get_runs(dg.RunsFilter(tags={"eagle3/retrain": "vllm"},
                                                            created_after=datetime.fromtimestamp(t0, tz=timezone.utc)))
            answers = {r.run_id[:8]: (r.tags.get("eagle3/drift_server"), r.tags.get("eagle3/drift_report")) for r in since}
            assert not [a for a in answers.values() if a[0] == "broken" or a[1] == str(report["storage_id"])], answers
        finally:
            daemon.cli("dagster", "sensor", "stop", "retrain_on_drift_sensor", "-w", str(ROOT / "workspace.yaml"))
            daemon.stop()
