"""Acting on drift, without a server: the traffic cut into what a retraining learns and what the gate measures, the
old data mixed into a finetune, the gate's verdict, and the production record (promote and roll back, from the CLI
and as the asset the UI materializes). The whole loop with a real vLLM server: test_serving_eye.py."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TINY_TRAIN, run_stage
from eagle3_assets import cli
from eagle3_assets.common import load_mix
from eagle3_assets.loop import production
from eagle3_assets.loop.promotion import BEATS, HOLDS, speed_noise, verdict
from eagle3_assets.story.gateway import OTHER_LANGUAGES, chat_prompts
from eagle3_assets.worker.data.traffic_split import held_out
from eagle3_assets.worker.training.data import ShardSet


def _day(path: Path, texts: list[str]) -> str:
    pq.write_table(pa.Table.from_pylist([{"id": f"{path.stem}-{i}", "source": "gw", "num_user_turns": 1,
                                          "messages": [{"role": "user", "content": t}], "kind": "x"}
                                         for i, t in enumerate(texts)]), path)
    return str(path)


def test_the_traffic_is_cut_by_prompt_so_the_gate_never_measures_on_what_was_trained(tmp_path):
    texts = OTHER_LANGUAGES + chat_prompts(30)
    a = _day(tmp_path / "2026-12-03.parquet", texts[:40])
    b = _day(tmp_path / "2026-12-04.parquet", texts[30:] + texts[:5])  # repeats across the days
    done = run_stage(tmp_path, "traffic_split", {"days": [b, a], "out_dir": "retrain", "min_prompts": 10})
    assert done.returncode == 0, done.stderr
    train = pq.read_table(tmp_path / "retrain/train.parquet").to_pylist()
    held = pq.read_table(tmp_path / "retrain/heldout.parquet").to_pylist()
    texts_in = lambda rows: [r["messages"][0]["content"] for r in rows]  # noqa: E731
    assert not set(texts_in(train)) & set(texts_in(held))
    assert sorted(texts_in(train) + texts_in(held)) == sorted(set(texts))  # each prompt once, repeats dropped
    assert all(held_out(r["messages"], 0.2) for r in held) and not any(held_out(r["messages"], 0.2) for r in train)
    assert 0.05 < len(held) / len(texts) < 0.4
    assert set(pq.read_schema(tmp_path / "retrain/train.parquet").names) == {"id", "source", "messages",
                                                                            "num_user_turns"}
    few = run_stage(tmp_path, "traffic_split", {"days": [a], "out_dir": "retrain2", "min_prompts": 100})
    assert few.returncode != 0 and "too little new traffic" in few.stderr and "nothing is retrained" in few.stderr
    assert not (tmp_path / "retrain2").exists()


def test_a_weighted_split_gives_the_worst_served_slice_more_of_the_same_budget(tmp_path):
    # a day of traffic with served figures: English chat served at 2.0, other languages at 1.25 (k=3)
    chat, other = chat_prompts(60), OTHER_LANGUAGES * 2
    other = [f"{t} ({i})" for i, t in enumerate(other)][:30]
    rows = [{"id": f"c{i}", "source": "gw", "num_user_turns": 1, "messages": [{"role": "user", "content": t}],
             "kind": "prose", "served_steps": 20, "served_accepted": 20} for i, t in enumerate(chat)]
    rows += [{"id": f"o{i}", "source": "gw", "num_user_turns": 1, "messages": [{"role": "user", "content": t}],
              "kind": "other-language", "served_steps": 40, "served_accepted": 10} for i, t in enumerate(other)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "day.parquet")
    base = {"days": ["day.parquet"], "min_prompts": 10, "min_group": 5}
    uniform = run_stage(tmp_path, "traffic_split", {**base, "out_dir": "u", "weight_by": None})
    weighted = run_stage(tmp_path, "traffic_split", {**base, "out_dir": "w", "max_boost": 3})  # by kind: the default
    assert uniform.returncode == 0 and weighted.returncode == 0, uniform.stderr + weighted.stderr
    u, w = (pq.read_table(tmp_path / d / "train.parquet").to_pylist() for d in ("u", "w"))
    share = lambda rows: sum(r["id"].startswith("o") for r in rows) / len(rows)  # noqa: E731
    assert len(w) == len(u), "the same budget of training prompts"
    # boost = (2.0 - 1) / (1.25 - 1) = 4, held to max_boost 3: the slice's share x3 before renormalizing
    expect = 3 * share(u) / (3 * share(u) + 1 - share(u))
    assert abs(share(w) - expect) < 2 / len(u), (share(u), share(w), expect)
    assert len({r["id"] for r in w}) == len(w), "a repeated prompt gets an id of its own"
    assert {r["messages"][0]["content"] for r in w if r["id"].startswith("o")} == \
        {r["messages"][0]["content"] for r in u if r["id"].startswith("o")}, "every prompt of the slice, then repeats"
    held = {r["messages"][0]["content"] for r in pq.read_table(tmp_path / "w/heldout.parquet").to_pylist()}
    assert not held & {r["messages"][0]["content"] for r in w}, "the held-out part is the uniform split's"
    assert "weighted by kind: other-language (served 1.25, boost 3.0" in weighted.stderr, weighted.stderr
    # without served figures nothing is weighted, and it says so
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("id", "source", "num_user_turns", "messages")}
                                         for r in rows]), tmp_path / "plain.parquet")
    plain = run_stage(tmp_path, "traffic_split", {**base, "days": ["plain.parquet"], "out_dir": "p",
                                                  "weight_by": "kind"})
    assert plain.returncode == 0 and "served figures" in plain.stderr and ": uniform" in plain.stderr, plain.stderr
    assert pq.read_table(tmp_path / "p/train.parquet").num_rows == len(u)
    # figures logged before the drafter in production was promoted were another drafter's: they weigh nothing
    stamped = [{**r, "timestamp": 1000.0} for r in rows]
    pq.write_table(pa.Table.from_pylist(stamped), tmp_path / "stamped.parquet")
    old = run_stage(tmp_path, "traffic_split", {**base, "days": ["stamped.parquet"], "out_dir": "s",
                                                "weight_by": "kind", "served_since": 2000.0})
    assert old.returncode == 0 and "since the drafter's promotion" in old.stderr, old.stderr
    assert pq.read_table(tmp_path / "s/train.parquet").to_pylist() == u


def test_a_finetune_mixes_in_the_share_of_old_samples_it_is_told(built):
    shards = sorted((built.workdir / "hidden_states").glob("shard-*"))
    new, old = ShardSet([shards[0]], 576), ShardSet([shards[1]], 576)
    mixed = ShardSet([shards[0]], 576, mix_dirs=[shards[1]], mix_share=0.5, seed=3)
    n, m = len(new.refs), len(old.refs)
    assert mixed.mix["new_samples"] == n and mixed.mix["old_samples"] == min(n, m)
    assert mixed.refs[:n] == new.refs and set(mixed.refs[n:]) <= set(old.refs)
    again = ShardSet([shards[0]], 576, mix_dirs=[shards[1]], mix_share=0.5, seed=3)
    assert again.refs == mixed.refs and again.identity == mixed.identity
    none = ShardSet([shards[0]], 576, mix_dirs=[shards[1]], mix_share=0.0)
    assert none.refs == new.refs and none.identity != mixed.identity  # another training set, another fingerprint


def _figures(champ_traffic, chall_traffic, champ_eval, chall_eval, speedups=(1.1, 1.3)):
    return {"champion": {"traffic": {"acceptance_length": champ_traffic, "speedup": speedups[0]},
                         "eval": {"acceptance_length": champ_eval}},
            "challenger": {"traffic": {"acceptance_length": chall_traffic, "speedup": speedups[1]},
                           "eval": {"acceptance_length": chall_eval}}}


def test_the_gate_wants_a_margin_on_the_traffic_and_a_tolerance_on_the_eval_set():
    """Acceptance on the held-out traffic must gain the margin; speed must hold within its tolerance."""
    ok = verdict(_figures(1.40, 1.60, 1.90, 1.88), margin=0.02, tolerance=0.03)
    assert ok[BEATS][0] and ok[HOLDS][0]
    close = verdict(_figures(1.40, 1.42, 1.90, 1.90), margin=0.02, tolerance=0.03)
    assert not close[BEATS][0] and "must be >= +2%" in close[BEATS][1]
    slower = verdict(_figures(1.40, 1.60, 1.90, 1.90, speedups=(1.2, 1.1)), margin=0.02, tolerance=0.03)
    assert not slower[BEATS][0] and "speedup 1.100 vs the champion's 1.200" in slower[BEATS][1]
    assert "must be >= -5%" in slower[BEATS][1]
    # better acceptance at a speed within the host's noise: promoted (CI measured +17 % acceptance at +0.8 % speed)
    level = verdict(_figures(1.317, 1.541, 1.88, 1.84, speedups=(1.2072, 1.2171)), margin=0.02, tolerance=0.03)
    assert level[BEATS][0], level[BEATS][1]
    strict = verdict(_figures(1.317, 1.541, 1.88, 1.84, speedups=(1.2072, 1.2171)), margin=0.02, tolerance=0.03,
                     speed_tolerance=-0.02)  # a team that wants a speed gain as well says so
    assert not strict[BEATS][0] and "must be >= +2%" in strict[BEATS][1]
    forgot = verdict(_figures(1.40, 1.70, 1.90, 1.70), margin=0.02, tolerance=0.03)
    assert forgot[BEATS][0] and not forgot[HOLDS][0]


def test_the_gate_allows_the_spread_its_rounds_measured_not_a_fixed_guess():
    """Issue 59: the 2-core preset's speed_tolerance 0.3 let a challenger 30 % slower through. The gate serves both
    drafters and the target alone in paired rounds; the speed check allows speed_tolerance plus the spread those
    rounds measured (half the sum of the interquartile ranges, each relative to its median): slower beyond the
    noise is refused, within it passes, and no spread measured allows the tolerance alone."""
    figs = _figures(1.40, 1.60, 1.90, 1.90, speedups=(1.20, 1.08))  # 10 % slower
    assert not verdict(figs, margin=0.02, tolerance=0.03)[BEATS][0]
    noisy = {"median": 1.2, "q1": 1.1, "q3": 1.3, "rounds": 6}  # an IQR of 0.2: 16.7 % of the median
    for label in ("champion", "challenger"):
        figs[label]["traffic"]["speedup_spread"] = {**noisy, "median": figs[label]["traffic"]["speedup"]}
    assert speed_noise(figs["champion"]["traffic"]["speedup_spread"],
                       figs["challenger"]["traffic"]["speedup_spread"]) == pytest.approx((0.2 / 1.2 + 0.2 / 1.08) / 2,
                                                                                         abs=1e-4)
    within = verdict(figs, margin=0.02, tolerance=0.03)
    assert within[BEATS][0] and "the rounds' spread 17.6%" in within[BEATS][1], within[BEATS][1]
    tight = {"median": 1.2, "q1": 1.19, "q3": 1.21, "rounds": 6}
    for label in ("champion", "challenger"):
        figs[label]["traffic"]["speedup_spread"] = {**tight, "median": figs[label]["traffic"]["speedup"]}
    beyond = verdict(figs, margin=0.02, tolerance=0.03)
    assert not beyond[BEATS][0] and "must be >= -6.8%" in beyond[BEATS][1], beyond[BEATS][1]
    figs["challenger"]["traffic"]["speedup_spread"]["rounds"] = 2  # too few rounds to say: the tolerance alone
    assert speed_noise(figs["champion"]["traffic"]["speedup_spread"],
                       figs["challenger"]["traffic"]["speedup_spread"]) == 0.0


def test_the_load_mix_weighs_the_output_each_batch_size_made_and_ignores_idle_windows():
    # (mean batch, output tokens) per window: idle windows made nothing; 0.7 and 1.2 are one request at a time
    windows = [(0.7, 100), (1.2, 50), (3.5, 400), (15.0, 300), (40.0, 5), (0.0, 0)]
    mix = load_mix.from_windows(windows, max_levels=3)
    assert mix == pytest.approx({1: 150 / 850, 4: 400 / 850, 16: 300 / 850}, abs=1e-4)  # 32's 5 tokens: not kept
    assert load_mix.from_windows([(0.0, 0)]) == {}
    assert load_mix.from_windows(windows, max_levels=1) == {4: 1.0}


def test_a_drafter_that_wins_alone_and_loses_under_load_is_judged_at_the_mix():
    base = {1: 100.0, 16: 400.0}
    fast_alone = {1: 150.0, 16: 320.0}  # 1.5x at 1, 0.8x at 16
    assert load_mix.speedup({1: 1.0}, fast_alone, base) == pytest.approx(1.5)
    # half the output at 16: the target alone takes 0.5/100 + 0.5/400 of a second a token, the drafter 0.5/150 + 0.5/320
    half = load_mix.speedup({1: 0.5, 16: 0.5}, fast_alone, base)
    assert half == pytest.approx((0.5 / 100 + 0.5 / 400) / (0.5 / 150 + 0.5 / 320))
    assert load_mix.speedup({1: 0.1, 16: 0.9}, fast_alone, base) < 1 < half
    assert load_mix.speedup({1: 0.5, 4: 0.5}, fast_alone, base) is None  # 4 was not measured: no figure, not a guess
    with pytest.raises(load_mix.LoadMixError, match="'many' is not a concurrency"):
        load_mix.check({"many": 1.0})
    with pytest.raises(load_mix.LoadMixError, match="shares above 0"):
        load_mix.check({"4": 0})
    assert load_mix.check({"16": 1, "1": 3}) == {1: 0.75, 16: 0.25}


def test_a_stall_on_one_servers_batch_does_not_decide_the_gates_speedup():
    from eagle3_assets.worker.serving.bench import paired_speedup
    from eagle3_assets.worker.serving.compare import _at_mix
    base = [40.0, 38.0, 41.0, 39.0, 40.0, 42.0, 38.0, 40.0]  # tokens/s of each batch the target alone served
    mine = [round(1.3 * b, 2) for b in base]
    mine[0] = 8.0  # the host stalled (a sensor's tick, a kernel built on first use) during one of the drafter's batches
    assert sum(mine) / sum(base) < 1.2  # the sums' ratio the stall dragged down
    assert paired_speedup(mine, base) == pytest.approx(1.3, abs=0.01)
    assert paired_speedup([0.0, 10.0, 30.0], [10.0, 10.0, 10.0]) == pytest.approx(2.0)  # an empty batch is no ratio
    assert paired_speedup([], []) is None
    with pytest.raises(ValueError):
        paired_speedup([1.0, 2.0], [1.0])
    # the gate's figure at the mix weighs the paired speedups, and its speedups by concurrency say the same
    fig = {"speedup": 1.3, "tokens_per_s_by_concurrency": {"1": 20.8, "4": 119.6}}
    base_fig = {"tokens_per_s_by_concurrency": {"1": 40.0, "4": 60.0}}
    _at_mix(fig, base_fig, {1: 0.5, 4: 0.5}, "challenger", type("R", (), {"log": lambda self, m: None})(),
            {1: 1.3, 4: 1.1})
    assert fig["speedup_by_concurrency"] == {"1": 1.3, "4": 1.1}
    assert fig["speedup"] == pytest.approx(load_mix.speedup({1: 0.5, 4: 0.5}, {1: 52.0, 4: 66.0}, {1: 40.0, 4: 60.0}),
                                           abs=1e-3)
    assert fig["speedup_at_first_concurrency"] == 1.3


def test_the_gate_reads_the_load_mix_the_engines_servers_served(tmp_path, monkeypatch):
    import dagster as dg

    from eagle3_assets.eye import served_load as eye_mix
    from eagle3_assets.eye.servers_file import SERVERS_ENV, asset_key

    servers = tmp_path / "servers.yaml"
    servers.write_text("servers:\n  - {name: a, url: 'http://127.0.0.1:9', engine: vllm}\n"
                       "  - {name: b, url: 'http://127.0.0.1:8', engine: vllm}\n"
                       "  - {name: s, url: 'http://127.0.0.1:7', engine: sglang}\n")
    with dg.instance_for_test() as instance:
        assert eye_mix.observed(instance, "vllm", 24) == ({}, f"no servers file ({SERVERS_ENV}): no production load "
                                                              "observed")
        monkeypatch.setenv(SERVERS_ENV, str(servers))
        mix, why = eye_mix.observed(instance, "vllm", 24)
        assert mix == {} and "no output with load figures from a, b in the last 24 h" in why
        for name, batch, tokens in [("a", 1.0, 300), ("b", 7.0, 100), ("s", 30.0, 10_000), ("a", 0.0, 0)]:
            instance.report_runless_asset_event(dg.AssetObservation(asset_key(name), metadata={
                "mean_requests_running": batch, "generation_tokens": tokens, "window_s": 60.0}))
        mix, why = eye_mix.observed(instance, "vllm", 24)
        assert mix == {1: 0.75, 8: 0.25}, why  # the sglang server's load is not vLLM's
        assert why.startswith("observed on a, b over the last 24 h (3 windows, 400 output tokens): 75% at 1, 25% at 8")


@pytest.fixture(scope="module")
def two_exports(built):
    """Two exported drafters of the shared graph: two checkpoints to put in production and take back."""
    out = []
    for name, lr in (("prod-a", 3e-3), ("prod-b", 1e-3)):
        built.materialize("eagle3_drafter", "drafter_export",
                          config={"eagle3_drafter": {"config": {**TINY_TRAIN, "run_name": name, "lr": lr}}})
        out.append(built.data_version("eagle3_drafter"))
    return built, out


def test_promote_and_rollback_from_the_cli_are_recorded_with_what_they_replaced(two_exports, monkeypatch, capsys):
    built, (a, b) = two_exports
    monkeypatch.setenv("DAGSTER_HOME", built.instance.root_directory)
    assert cli.main(["rollback"]) == 2 and "nothing is in production" in capsys.readouterr().err
    assert cli.main(["promote", "--version", a[:10], "--why", "first"]) == 0
    assert cli.main(["promote"]) == 0  # the newest export: b
    now = production.current(built.instance, "vllm")
    assert now["version"] == b and now["replaced"] == a and now["decision"] == "promoted by hand"
    assert cli.main(["rollback", "--why", "b misbehaves"]) == 0
    now = production.current(built.instance, "vllm")
    assert (now["version"], now["replaced"], now["decision"], now["why"]) == (a, b, "rolled back", "b misbehaves")
    export = production.export_of(built.instance, a)
    assert now["export_path"] == export["vllm_path"] and now["trained_path"] == export["source"]
    capsys.readouterr()
    assert cli.main(["production"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("now") and "rolled back" in lines[0] and len(lines) == 3
    assert cli.main(["promote", "--version", "deadbeef00"]) == 2
    assert "no drafter_export of checkpoint deadbeef00" in capsys.readouterr().err


def test_the_production_asset_takes_the_same_decisions_from_the_ui(two_exports):
    built, (a, b) = two_exports
    for version in (a, b):
        built.materialize("production_drafter", partition="vllm", config={"production_drafter": {"config": {
            "action": "promote", "version": version}}})
        assert production.current(built.instance, "vllm")["version"] == version
    built.materialize("production_drafter", partition="vllm", config={"production_drafter": {"config": {
        "action": "rollback", "version": a}}})
    now = production.current(built.instance, "vllm")
    assert now["version"] == a and now["decision"] == "rolled back" and now["replaced"] == b
    refused = built.materialize("production_drafter", partition="vllm", raise_on_error=False,
                                config={"production_drafter": {"config": {"action": "gate"}}})
    assert not refused.success  # no gate has passed: nothing to promote
    assert production.current(built.instance, "vllm")["version"] == a
    assert json.dumps(production.history(built.instance, "vllm"), default=str).count("rolled back") >= 1


def test_drift_starts_one_retraining_per_engine_and_refuses_a_second_while_one_runs():
    import dagster as dg

    from eagle3_assets.eye.servers_file import ServersFile
    from eagle3_assets.loop import on_drift as loop

    def drift(server: str) -> None:
        instance.report_runless_asset_event(dg.AssetMaterialization("drift_report", metadata={"server": server}))

    parsed = ServersFile.model_validate({"servers": [{"name": "a", "url": "http://127.0.0.1:1", "engine": "vllm"},
                                                     {"name": "b", "url": "http://127.0.0.1:2", "engine": "vllm"}]})
    sensor = loop.build(parsed)
    with dg.instance_for_test() as instance:
        drift("a")
        drift("b")  # two drift reports at once for one engine: one retraining
        got = sensor(dg.build_sensor_context(instance=instance))
        assert [(r.partition_key, r.tags[loop.RETRAIN_TAG]) for r in got.run_requests] == [("vllm", "vllm")]
        instance.add_run(dg.DagsterRun(job_name="retrain_on_traffic", run_id="r1", tags={loop.RETRAIN_TAG: "vllm"},
                                       status=dg.DagsterRunStatus.STARTED))
        drift("a")  # while it runs: refused, and said
        again = sensor(dg.build_sensor_context(instance=instance, cursor=got.cursor))
        assert not again.run_requests and "queued or running" in again.skip_reason.skip_message


def test_an_online_retraining_extracts_no_shard(tmp_path, monkeypatch):
    """With the challenger set to train online (EAGLE3_RETRAIN_CONFIG), the sensor's retraining runs the loop
    without retrain_shards; without it, the whole loop."""
    import dagster as dg
    import yaml

    from eagle3_assets.eye.servers_file import ServersFile
    from eagle3_assets.loop import on_drift as loop

    parsed = ServersFile.model_validate({"servers": [{"name": "a", "url": "http://127.0.0.1:1", "engine": "vllm"}]})
    for online, cfg in [(False, {}), (True, {"hidden_states": "online", "mix_share": 0.0})]:
        (tmp_path / "retrain.yaml").write_text(yaml.safe_dump({"ops": {"challenger_drafter": {"config": cfg}}}))
        monkeypatch.setenv(loop.CONFIG_ENV, str(tmp_path / "retrain.yaml"))
        with dg.instance_for_test() as instance:
            instance.report_runless_asset_event(dg.AssetMaterialization("drift_report", metadata={"server": "a"}))
            (req,) = loop.build(parsed)(dg.build_sensor_context(instance=instance)).run_requests
        if online:
            assert [k.to_user_string() for k in req.asset_selection] == [a for a in loop.LOOP if a != "retrain_shards"]
        else:
            assert req.asset_selection is None  # the job's whole selection


def test_a_control_plane_killed_mid_promotion_leaves_the_record_whole(two_exports):
    """`eagle3-assets promote` killed (SIGKILL, its own process group) at points through its run: each decision in
    the record is whole or absent, and production is the drafter before or the one promoted, never a mix."""
    import os
    import signal
    import subprocess
    import sys
    import time

    built, (a, b) = two_exports
    env = {**os.environ, "DAGSTER_HOME": built.instance.root_directory}
    argv = [sys.executable, "-m", "eagle3_assets.cli", "promote", "--version", a[:10], "--why", "killed"]
    for delay in (1.0, 2.0, 3.0, 4.0, 5.0):
        before = production.current(built.instance, "vllm")
        proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        now = production.current(built.instance, "vllm")
        assert now in (before,) or (now["version"] == a and now["why"] == "killed")
        for h in production.history(built.instance, "vllm"):
            assert h["version"] and h["export_path"] and h["decision"] and h["replaced"], h
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert production.current(built.instance, "vllm")["version"] == a
