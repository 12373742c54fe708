"""The speculation schedule by load (eagle3_assets/common/spec_schedule.py): chosen from a load curve, refused when
malformed before any server starts, and written in the form each engine reads, checked against vLLM's own
validator (imported) and SGLang 0.5.14's config loader (its source, read, never imported)."""

import ast
import bisect
import json
import os
import shutil
from pathlib import Path

import pytest

from eagle3_assets.common import spec_schedule as ss

SGLANG_SRC = Path(__file__).resolve().parents[2] / ".venv" / "engine-src" / "sglang-0.5.14" / "sglang"

# A load curve shaped as the 2-core measurement (tokens/s): speculation wins alone, loses under load
CURVE = {0: {1: 28.7, 2: 52.0, 4: 89.2, 8: 140.0, 16: 218.1, 32: 270.0},
         1: {1: 37.0, 2: 63.0, 4: 99.0, 8: 142.0, 16: 200.0, 32: 240.0},
         3: {1: 43.3, 2: 70.0, 4: 106.6, 8: 131.0, 16: 176.6, 32: 190.0}}


def test_the_schedule_drafts_where_it_pays_and_stops_where_the_target_alone_is_faster():
    schedule, rows = ss.choose(CURVE, max_batch=256, tolerance=0.03)
    assert schedule == [(1, 4, 3), (5, 8, 1), (9, 256, 0)], schedule
    assert ss.k_at(schedule, 1) == 3 and ss.k_at(schedule, 16) == 0 and ss.k_at(schedule, 500) == 0
    by_c = {r["concurrency"]: r for r in rows}
    assert by_c[16]["k"] == 0 and by_c[16]["speedup"] == 1.0 and by_c[1]["speedup"] == round(43.3 / 28.7, 3)
    assert ss.describe(schedule) == "1-4: k=3, 5-8: k=1, 9-256: off"


def test_noise_within_the_tolerance_does_not_flip_a_range():
    # at 8, k=1 beats k=3 by 1 %: within a 3 % tolerance k=3 is kept, with none k=3 is replaced
    curve = {0: {1: 10.0, 8: 50.0}, 1: {1: 13.0, 8: 60.6}, 3: {1: 15.0, 8: 60.0}}
    assert ss.choose(curve, max_batch=16, tolerance=0.03)[0] == [(1, 8, 3), (9, 16, 0)]
    assert ss.choose(curve, max_batch=16, tolerance=0.0)[0] == [(1, 1, 3), (2, 8, 1), (9, 16, 0)]


def test_where_k_rises_the_higher_k_starts_at_the_measured_point():
    curve = {0: {1: 10.0, 4: 30.0}, 1: {1: 12.0, 4: 31.0}, 2: {1: 11.0, 4: 40.0}}
    assert ss.choose(curve, max_batch=8, tolerance=0.0)[0] == [(1, 3, 1), (4, 4, 2), (5, 8, 0)]


def test_past_the_largest_concurrency_measured_nothing_is_speculated_on():
    """Issue 59: a grid stopping at 16 shipped k = 1 up to 1,024 requests at once, and served 0.79x at 32."""
    curve = {0: {1: 10.0, 16: 100.0}, 1: {1: 13.0, 16: 104.0}}
    rounds = {1: {1: [1.3, 1.31, 1.28, 1.3], 16: [1.05, 1.04, 1.06, 1.05]}}
    assert ss.choose(curve, max_batch=1024, rounds=rounds)[0] == [(1, 16, 1), (17, 1024, 0)]
    assert ss.speculate_up_to([(1, 16, 1), (17, 1024, 0)]) == 16


def test_a_k_speculates_only_where_its_paired_rounds_agree_it_wins():
    """Issue 59's sweep: k=2 against the target alone at 4 requests, +3 % on its means (52.74 against 51.02 tok/s),
    its rounds one side and the other of 1: no win, off. A win the rounds agree on is taken; two rounds are too few
    to say."""
    curve = {0: {1: 10.0, 4: 51.02}, 2: {1: 13.5, 4: 52.74}}
    noisy = {2: {1: [1.36, 1.33, 1.38, 1.35, 1.34], 4: [1.09, 0.96, 1.07, 0.98, 1.06]}}
    schedule, rows = ss.choose(curve, max_batch=8, rounds=noisy)
    assert schedule == [(1, 1, 2), (2, 8, 0)]
    assert rows[1]["k"] == 0 and rows[1]["k2_ratio"] == {"median": 1.06, "q1": 0.98, "q3": 1.07, "rounds": 5}
    agreed = {2: {1: noisy[2][1], 4: [1.09, 1.06, 1.07, 1.08, 1.06]}}
    assert ss.choose(curve, max_batch=8, rounds=agreed)[0] == [(1, 4, 2), (5, 8, 0)]
    two = {2: {1: [1.36, 1.33], 4: [1.09, 1.08]}}
    assert ss.choose(curve, max_batch=8, rounds=two)[0] == [(1, 8, 0)]
    assert ss.wins([1.03, 1.04, 1.05]) and not ss.wins([0.99, 1.04, 1.05])  # lower quartiles 1.035, 1.015


def test_the_verification_falls_back_to_off_where_the_scheduled_server_does_not_pay():
    """Issue 59: a sweep chose k=2 at 4 on margins its own verification did not find (0.91x at 4, 0.95x at 16). The
    scheduled server's paired rounds at each concurrency against the sweep's choice: slower than the target alone is
    off; below the sweep beyond the tolerance but still winning by the sweep's rule keeps its k, said; a point already
    off is not judged."""
    table = [{"concurrency": 1, "k": 2, "speedup": 1.41}, {"concurrency": 4, "k": 2, "speedup": 1.06},
             {"concurrency": 16, "k": 1, "speedup": 1.05}, {"concurrency": 32, "k": 0, "speedup": 1.0}]
    verified = {1: ss.spread([1.30, 1.28, 1.33, 1.31]),    # below the sweep's 1.41 by 8 %, still a clear win
                4: ss.spread([0.93, 0.90, 0.92, 0.89]),    # slower than the target alone
                16: ss.spread([1.04, 0.97, 1.06, 1.00]),   # median 1.02: within 3 % of the sweep's 1.05
                32: ss.spread([0.95, 0.96, 0.97, 0.96])}   # off already: the k = 0 cost, not judged here
    rows, off = ss.verify(table, verified, tolerance=0.03)
    by = {r["concurrency"]: r for r in rows}
    assert off == {4}
    assert not by[1]["agrees"] and not by[1]["falls_back_to_off"]  # said, and kept: its own rounds win
    assert by[4]["verified_speedup"] == 0.91 and by[4]["falls_back_to_off"]
    assert by[16]["agrees"] and not by[16]["falls_back_to_off"]
    assert not by[32]["falls_back_to_off"]
    # at 16 below the tolerance and no win of its own: off too
    rows, off = ss.verify(table, {**verified, 16: ss.spread([1.01, 0.99, 1.02, 1.0])}, tolerance=0.03)
    assert off == {4, 16}
    chosen = [(r["concurrency"], 0 if r["concurrency"] in off else r["k"]) for r in table]
    assert ss.from_points(chosen, 1024) == [(1, 1, 2), (2, 1024, 0)]
    assert ss.from_points([(1, 2), (4, 0), (16, 1), (32, 0)], 1024) == [(1, 1, 2), (2, 15, 0), (16, 16, 1),
                                                                       (17, 1024, 0)]


def test_where_the_verification_falls_back_the_benchmark_rewrites_the_launch_files(tmp_path, capsys):
    """serve_bench's verification: the files a team and the rollout start servers with (beside the export) say the
    schedule as it fell back, routing.json too; a verification that keeps every k leaves them as the sweep wrote
    them."""
    from eagle3_assets.stages.serve_bench import ServeBenchArgs
    from eagle3_assets.worker import engines
    from eagle3_assets.worker.report import Reporter
    from eagle3_assets.worker.serving import bench, launch_files

    export = tmp_path / "exports" / "v1" / "vllm"
    export.mkdir(parents=True)
    sweep = [(1, 4, 2), (5, 16, 1), (17, 1024, 0)]
    launch = tmp_path / "exports" / "v1" / "vllm-launch"
    launch_files.write(launch, str(export), sweep)
    table = [{"concurrency": 1, "k": 2, "speedup": 1.4}, {"concurrency": 4, "k": 2, "speedup": 1.1},
             {"concurrency": 16, "k": 1, "speedup": 1.05}]
    args = ServeBenchArgs(target="t", drafter=str(export), prompts="p", history="h", out_dir="o",
                          schedule=[list(r) for r in sweep],
                          verify={"table": table, "max_batch": 1024, "tolerance": 0.03})
    results = {("eagle3", c): {"paired_spread": ss.spread(r)} for c, r in
               {1: [1.38, 1.41, 1.36, 1.4], 4: [1.08, 1.12, 1.09, 1.1], 16: [1.06, 1.04, 1.05, 1.07]}.items()}
    kept = bench._verify(engines.get("vllm"), args, results, str(export), Reporter())
    assert kept["verification_agrees"] and "verified_schedule" not in kept and len(kept["verification"]) == 3
    before = (launch / "speculative_config.vllm.json").read_text()
    assert json.loads(before)["num_speculative_tokens_per_batch_size"] == [list(r) for r in sweep]

    results[("eagle3", 16)] = {"paired_spread": ss.spread([0.96, 0.94, 0.97, 0.95])}  # served slower at 16
    fell = bench._verify(engines.get("vllm"), args, results, str(export), Reporter())
    assert fell["fell_back_at"] == [16] and fell["verified_schedule_text"] == "1-4: k=2, 5-1024: off"
    cfg = json.loads((launch / "speculative_config.vllm.json").read_text())
    assert cfg["num_speculative_tokens_per_batch_size"] == [[1, 4, 2], [5, 1024, 0]]
    assert json.loads((launch / "routing.json").read_text())["speculate_up_to"] == 4
    assert "the schedule falls back to off at [16]" in capsys.readouterr().err


def test_a_schedule_that_fell_back_is_the_one_served_after_its_benchmark():
    """The rollout, the eye and the next benchmark read the schedule as its verification left it (the launch files the
    benchmark rewrote), further fallbacks on top; a benchmark of another schedule or checkpoint changes nothing, and
    a sweep measured again starts over."""
    import dagster as dg

    from eagle3_assets.assets.speculation_schedule import schedule_for

    sweep = [[1, 4, 2], [5, 16, 1], [17, 1024, 0]]
    with dg.instance_for_test() as instance:
        def event(asset: str, **meta):
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition="vllm", metadata=meta))

        event("speculation_schedule", checkpoint="a" * 32, schedule=sweep, schedule_text=ss.describe(sweep))
        event("serving_benchmark", checkpoint="a" * 32, schedule=sweep)  # verified: nothing fell back
        assert schedule_for(instance, "vllm", "a" * 32)[0]["schedule"] == sweep
        first = [[1, 4, 2], [5, 1024, 0]]
        event("serving_benchmark", checkpoint="b" * 32, schedule=sweep, verified_schedule=[[1, 1024, 0]],
              verified_schedule_text="1-1024: off", fell_back_at=[1, 16])  # another checkpoint's
        event("serving_benchmark", checkpoint="a" * 32, schedule=sweep, verified_schedule=first,
              verified_schedule_text=ss.describe(first), fell_back_at=[16])
        got, why = schedule_for(instance, "vllm", "a" * 32)
        assert got["schedule"] == first and got["measured_schedule"] == sweep and "off at [16]" in why
        again = [[1, 1, 2], [2, 1024, 0]]
        event("serving_benchmark", checkpoint="a" * 32, schedule=first, verified_schedule=again,
              verified_schedule_text=ss.describe(again), fell_back_at=[4])
        got, why = schedule_for(instance, "vllm", "a" * 32)
        assert got["schedule"] == again and got["fell_back_at"] == [4, 16] and got["measured_schedule"] == sweep
        event("speculation_schedule", checkpoint="a" * 32, schedule=sweep, schedule_text=ss.describe(sweep))
        assert schedule_for(instance, "vllm", "a" * 32)[0]["schedule"] == sweep


@pytest.mark.parametrize("bad, names", [
    ([[1, 4, 3], [4, 16, 0]], "ranges [1, 4, 3] and [4, 16, 0] overlap at batch size 4"),
    ([[2, 16, 3]], "range [2, 16, 3]: the first range must start at batch size 1"),
    ([[1, 4, 3], [8, 16, 0]], "leave batch sizes 5-7 without a k"),
    ([[1, 4, -1]], "range [1, 4, -1]: k is the number of drafted tokens"),
    ([[1, 4]], "range [1, 4]: each range is [first, last, k]"),
    ([], "non-empty list"),
    ([[1, 8, 3]], "ends at batch size 8, below the engine's limit of 16"),
])
def test_a_bad_schedule_is_refused_naming_the_range(bad, names):
    with pytest.raises(ss.ScheduleError) as e:
        ss.check(bad, max_batch=16)
    assert names in str(e.value), str(e.value)


def test_a_curve_missing_the_target_alone_or_one_request_is_refused():
    with pytest.raises(ss.ScheduleError, match="no k = 0"):
        ss.choose({3: {1: 2.0}}, max_batch=8)
    with pytest.raises(ss.ScheduleError, match="measure one request alone"):
        ss.choose({0: {2: 1.0}, 3: {2: 2.0}}, max_batch=8)
    with pytest.raises(ss.ScheduleError, match="same concurrencies"):
        ss.choose({0: {1: 1.0, 2: 2.0}, 3: {1: 2.0}}, max_batch=8)


def test_vllm_reads_the_config_as_the_schedule_means_it():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = [(1, 4, 3), (5, 12, 1), (13, 64, 0)]
    cfg = json.loads(ss.dumps(ss.vllm_config("eagle3", "/models/drafter", schedule)))
    assert cfg["num_speculative_tokens"] == 3
    lookup = build_dynamic_sd_schedule_lookup(cfg["num_speculative_tokens_per_batch_size"], 64,
                                              cfg["num_speculative_tokens"])
    assert [lookup[b] for b in range(1, 65)] == [ss.k_at(schedule, b) for b in range(1, 65)]
    # one k everywhere: a plain config; never speculating: no speculative config at all
    assert "num_speculative_tokens_per_batch_size" not in ss.vllm_config("eagle3", "d", [(1, 64, 2)])
    assert ss.vllm_config("eagle3", "d", [(1, 64, 0)]) == {}


@pytest.mark.skipif(not SGLANG_SRC.exists() and os.environ.get("CI") != "true",
                    reason="the SGLang 0.5.14 source is fetched by `.ci/setup --tests`")
def test_sglang_reads_the_adaptive_config_as_the_schedule_means_it(tmp_path):
    src = (SGLANG_SRC / "srt" / "speculative" / "adaptive_spec_params.py").read_text()
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_load_adaptive_config")
    ns = {"json": json, "DEFAULT_ADAPTIVE_CONFIG": {}}
    exec(compile(ast.Module([fn], []), "adaptive_spec_params.py", "exec"), ns)  # SGLang's own loader, alone
    schedule = [(1, 4, 3), (5, 12, 1), (13, 64, 0)]
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(ss.sglang_adaptive_config(schedule)))
    _, slots = ns["_load_adaptive_config"](str(path))
    keys = sorted(slots)
    assert "bisect.bisect_right(self._bs_list, target) - 1" in src  # SGLang's routing, as emulated here
    for b in range(1, 65):
        slot = slots[keys[max(0, bisect.bisect_right(keys, b) - 1)]]
        assert slot["candidate_steps"] == [ss.k_at(schedule, b)], b


def test_the_speedup_check_is_judged_at_every_measured_concurrency():
    from eagle3_assets.assets.serving import speedup

    # the fixed k = 3 server: 1.51x alone, 0.81x at 16 at once: the check fails, naming the load
    loses = speedup({"speedup": 1.51, "speedup_c1": 1.51, "speedup_c4": 1.20, "speedup_c16": 0.81})
    assert not loses.passed and "0.81x at 16 concurrent requests" in loses.description
    assert "1.20x" not in loses.description and loses.metadata["lowest_speedup"].value == 0.81
    pays = speedup({"speedup": 1.46, "speedup_c1": 1.46, "speedup_c16": 1.0})
    assert pays.passed and pays.metadata["concurrencies"].value == [1, 16]
    # where the schedule serves k = 0 nothing is speculated: that cost is schedule_never_slower's, not this check's
    off = speedup({"speedup": 1.46, "speedup_c1": 1.46, "speedup_c16": 0.96, "schedule": [[1, 4, 2], [5, 1024, 0]]})
    assert off.passed and off.metadata["not_speculating_at"].value == [16]
    drafting = speedup({"speedup": 1.46, "speedup_c1": 1.46, "speedup_c16": 0.96, "schedule": [[1, 1024, 2]]})
    assert not drafting.passed and "0.96x at 16" in drafting.description


def test_a_bad_schedule_is_refused_by_the_benchmark_before_any_server_starts():
    from eagle3_assets.stages import validate
    from eagle3_assets.stages.base import ArgsError

    args = {"target": "t", "drafter": "d", "prompts": "p.parquet", "history": "h.parquet", "out_dir": "o"}
    with pytest.raises(ArgsError) as e:
        validate("serve_bench", {**args, "schedule": [[1, 4, 3], [4, 16, 0]]})
    assert "schedule: ranges [1, 4, 3] and [4, 16, 0] overlap at batch size 4" in str(e.value), str(e.value)
    with pytest.raises(ArgsError, match=r"range \[2, 16, 3\]: the first range must start at batch size 1"):
        validate("serve_bench", {**args, "schedule": [[2, 16, 3]]})
    assert validate("serve_bench", {**args, "schedule": [[1, 4, 3], [5, 1024, 0]]}).schedule == [[1, 4, 3], [5, 1024, 0]]


def test_the_engines_are_started_with_the_schedule_in_their_own_flags():
    from eagle3_assets.worker.engines import sglang, vllm

    schedule = [(1, 4, 3), (5, 1024, 0)]
    common = dict(k=1, dtype="bfloat16", max_model_len=2048, seed=0, extra=[])
    argv = vllm.server_command("python", "/models/t", 8000, drafter="/exports/vllm", schedule=schedule, **common)
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert cfg == {"method": "eagle3", "model": "/exports/vllm", "num_speculative_tokens": 3,
                   "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 1024, 0]]}
    never = vllm.server_command("python", "/models/t", 8000, drafter="/exports/vllm", schedule=[(1, 1024, 0)], **common)
    assert "--speculative-config" not in never  # a schedule that never drafts serves the target alone
    argv = sglang.server_command("python", "/models/t", 30000, drafter="/exports/sglang", schedule=schedule, **common)
    assert argv[argv.index("--speculative-num-steps") + 1] == "3" and "--speculative-adaptive" in argv
    adaptive = json.loads(Path(argv[argv.index("--speculative-adaptive-config") + 1]).read_text())
    assert adaptive == {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}


@pytest.mark.skipif(not SGLANG_SRC.exists() and os.environ.get("CI") != "true",
                    reason="the SGLang 0.5.14 source is fetched by `.ci/setup --tests`")
def test_sglang_0_5_14_declares_the_adaptive_flags_we_pass():
    tree = ast.parse((SGLANG_SRC / "srt" / "server_args.py").read_text(encoding="utf-8-sig"))
    args = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    fields = {n.target.id for n in args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"speculative_adaptive", "speculative_adaptive_config", "speculative_num_steps"} <= fields


def test_the_rollouts_restart_gets_the_schedule_measured_for_the_drafter(tmp_path):
    from eagle3_assets.eye.servers_file import Server
    from eagle3_assets.loop import restart

    export = tmp_path / "exports" / "abc123" / "vllm"
    export.mkdir(parents=True)
    server = Server(name="prod", url="http://127.0.0.1:9", restart=[
        "python", "-m", "eagle3_assets.worker.serving.prod_server", "restart", "--drafter", "{drafter}",
        "--speculative-config", "{speculative_config}"], restart_timeout_s=5, ready_timeout_s=1)
    # no schedule measured for it: refused before anything runs, saying what to do
    why = restart.restart(server, str(export), lambda _: None)
    assert why and "materialize speculation_schedule for this drafter" in why and "{speculative_config}" in why
    launch = export.parent / "vllm-launch"
    launch.mkdir()
    (launch / "speculative_config.vllm.json").write_text(ss.dumps(ss.vllm_config("eagle3", str(export),
                                                                                 [(1, 4, 3), (5, 1024, 0)])))
    argv = restart.command(server, str(export))
    assert argv[argv.index("--drafter") + 1] == str(export)
    assert argv[argv.index("--speculative-config") + 1] == str(launch / "speculative_config.vllm.json")
    # the file is held to the schedule recorded for the drafter (the model's path aside: the host's)
    assert restart.launch_differs(str(export), "vllm", [[1, 4, 3], [5, 1024, 0]]) is None
    cfg = json.loads((launch / "speculative_config.vllm.json").read_text())  # a key of the team's own: still the same
    (launch / "speculative_config.vllm.json").write_text(json.dumps({**cfg, "draft_tensor_parallel_size": 1}))
    assert restart.launch_differs(str(export), "vllm", [[1, 4, 3], [5, 1024, 0]]) is None
    why = restart.launch_differs(str(export), "vllm", [[1, 8, 2], [9, 1024, 0]])
    assert why and "the schedule measured for this drafter is 1-8: k=2, 9-1024: off" in why


def test_a_drafter_the_loop_promoted_is_served_with_its_challengers_schedule():
    """serving_benchmark, the serving eye and the rollout find a checkpoint's schedule whichever asset measured it:
    speculation_schedule for the main drafter, challenger_schedule for one the loop promoted; a newer schedule of
    another checkpoint does not hide it, and a checkpoint never measured is named."""
    import dagster as dg

    from eagle3_assets.assets.speculation_schedule import schedule_for

    with dg.instance_for_test() as instance:
        def measured(asset: str, checkpoint: str, text: str):
            instance.report_runless_asset_event(dg.AssetMaterialization(
                asset, partition="vllm", metadata={"checkpoint": checkpoint, "schedule_text": text}))

        measured("speculation_schedule", "a" * 32, "1-2: k=3, 3-1024: off")
        measured("challenger_schedule", "b" * 32, "1-4: k=2, 5-1024: off")
        measured("speculation_schedule", "c" * 32, "1-1024: k=1")
        assert schedule_for(instance, "vllm", "b" * 32)[0]["schedule_text"] == "1-4: k=2, 5-1024: off"
        assert schedule_for(instance, "vllm", "a" * 32)[0]["schedule_text"] == "1-2: k=3, 3-1024: off"
        measured("challenger_schedule", "a" * 32, "1-8: k=2, 9-1024: off")  # measured again, later, by the loop
        assert schedule_for(instance, "vllm", "a" * 32)[0]["schedule_text"] == "1-8: k=2, 9-1024: off"
        none, why = schedule_for(instance, "vllm", "d" * 32)
        assert none is None and f"no speculation_schedule on vllm was measured for checkpoint {'d' * 12}" in why
        assert schedule_for(instance, "sglang", "a" * 32) == (None, "no speculation_schedule on sglang: materialize it "
                                                                    "(job measure_schedule) for this checkpoint")


def test_the_gates_batches_give_the_challengers_schedule_and_no_server_starts(tmp_path):
    """challenger_schedule `source: gate`: the schedule the gate chose from its own batches (the target alone's tokens/s
    at each concurrency of the load mix, the challenger's paired speedup there), written beside the export as a sweep's
    is, recorded for the checkpoint the gate judged, and refused for any other."""
    from types import SimpleNamespace

    import dagster as dg

    from eagle3_assets.assets.speculation_schedule import schedule_for
    from eagle3_assets.loop.challenger_schedule import from_gate
    from eagle3_assets.worker.serving.compare import schedule_from_batches

    export = tmp_path / "exports" / "cafe" / "vllm"
    export.mkdir(parents=True)
    figures = {"baseline": {"traffic": {"output_tokens_per_s": 30.0, "tokens_per_s_by_concurrency": {"1": 30.0,
                                                                                                   "4": 100.0}}},
               "challenger": {"traffic": {"speedup": 1.5, "speedup_by_concurrency": {"1": 1.6, "4": 0.85}}}}
    args = SimpleNamespace(schedule_of="challenger", schedule_dir="exports/cafe/vllm-launch", baseline=True,
                           extra_args=["--max-num-seqs", "64"])
    logged = []
    meta, none = schedule_from_batches(args, str(tmp_path), {"challenger": export}, figures, "traffic", 1, 3,
                                       {"engine": "vllm", "engine_version": "0.x"}, SimpleNamespace(log=logged.append))
    assert none is None
    # drafting pays alone (1.6x) and loses at 4 (0.85x): k = 3 for one request, none from 2 on, to the batch limit
    assert meta["schedule"] == [[1, 1, 3], [2, 64, 0]] and meta["ks"] == [0, 3] and meta["grid"] == [1, 4]
    assert meta["curve"]["3"] == {"1": pytest.approx(48.0), "4": pytest.approx(85.0)}
    launch = tmp_path / "exports" / "cafe" / "vllm-launch"
    cfg = json.loads((launch / "speculative_config.vllm.json").read_text())
    assert cfg["model"] == str(export) and cfg["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 64, 0]]
    assert json.loads((launch / "load_curve.json").read_text())["schedule_text"] == meta["schedule_text"]
    assert any("from these batches" in line for line in logged)
    # without the target alone there is nothing to choose from: said, no file
    got, why = schedule_from_batches(SimpleNamespace(**{**vars(args), "baseline": False}), str(tmp_path),
                                     {"challenger": export}, figures, "traffic", 1, 3, {},
                                     SimpleNamespace(log=logged.append))
    assert got is None and "baseline" in why and why in logged[-1]
    # nor without one request alone (a gate first measured at 2): the gate's verdict stands, the fix is named
    at2 = {"baseline": {"traffic": {"output_tokens_per_s": 50.0}}, "challenger": {"traffic": {"speedup": 1.2}}}
    got, why_at2 = schedule_from_batches(args, str(tmp_path), {"challenger": export}, at2, "traffic", 2, 3, {},
                                         SimpleNamespace(log=logged.append))
    assert got is None and "not one alone: add 1 to the gate's concurrencies" in why_at2 and "sweep" in why_at2
    # a schedule that never drafts (the challenger loses everywhere) leaves no config to start a server with: the
    # one written before is gone, not left to the rollout
    other = tmp_path / "other"
    (other / "exports" / "cafe" / "vllm-launch").mkdir(parents=True)
    shutil.copy(launch / "speculative_config.vllm.json", other / "exports" / "cafe" / "vllm-launch")
    loses = {"baseline": figures["baseline"], "challenger": {"traffic": {"speedup_by_concurrency": {"1": 0.7,
                                                                                                  "4": 0.6}}}}
    off, _ = schedule_from_batches(args, str(other), {"challenger": export}, loses, "traffic", 1, 3, {},
                                   SimpleNamespace(log=logged.append))
    assert off["schedule_text"] == "1-64: off"
    assert sorted(p.name for p in (other / "exports" / "cafe" / "vllm-launch").iterdir()) == [
        "adaptive.sglang.json", "load_curve.json", "routing.json"]

    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization("promotion_gate", partition="vllm", metadata={
            "challenger": "c" * 32, "schedule_from_batches": dg.MetadataValue.json(meta)}))
        got = from_gate(instance, "vllm", "c" * 32)
        instance.report_runless_asset_event(dg.AssetMaterialization("challenger_schedule", partition="vllm",
                                                                    metadata=got.metadata))
        sched, _ = schedule_for(instance, "vllm", "c" * 32)
        assert sched["schedule_text"] == "1-1: k=3, 2-64: off" and sched["path"] == str(launch)
        assert "k=3" in sched["table_md"] and sched["measured_by"].startswith("the promotion gate's batches")
        with pytest.raises(dg.Failure, match=f"judged {'c' * 12}, not {'d' * 12}.*source: sweep"):
            from_gate(instance, "vllm", "d" * 32)
        with pytest.raises(dg.Failure, match="no promotion_gate on sglang yet"):
            from_gate(instance, "sglang", "c" * 32)
        # a gate that chose none says why, as its stage did; a refused challenger gets no schedule
        instance.report_runless_asset_event(dg.AssetMaterialization("promotion_gate", partition="vllm", metadata={
            "challenger": "e" * 32, "no_schedule_from_batches": why_at2, "promote": True}))
        with pytest.raises(dg.Failure, match="chose no schedule from its batches: measured at \\[2\\] requests"):
            from_gate(instance, "vllm", "e" * 32)
        instance.report_runless_asset_event(dg.AssetMaterialization("promotion_gate", partition="vllm", metadata={
            "challenger": "f" * 32, "schedule_from_batches": dg.MetadataValue.json(meta), "promote": False,
            "decision": "keep the champion"}))
        with pytest.raises(dg.Failure, match=f"refused {'f' * 12}"):
            from_gate(instance, "vllm", "f" * 32)


def test_settings_only_a_sweep_uses_are_refused_with_the_gates_schedule():
    """challenger_schedule `source: gate` takes the gate's schedule as chosen (its concurrencies, its k, its tolerance):
    a tolerance or a batch limit given beside it would be ignored, so it is named, not dropped; config built by
    Dagster (its defaults filled in) names nothing."""
    import dagster as dg

    from eagle3_assets.loop.challenger_schedule import ChallengerScheduleConfig, sweep_settings

    seen = []

    @dg.asset
    def probe(config: ChallengerScheduleConfig):
        seen.append(sweep_settings(config))

    for cfg in ({"source": "gate"}, {"source": "gate", "tolerance": 0.1, "extra_args": ["--max-num-seqs", "32"]}):
        assert dg.materialize([probe], run_config={"ops": {"probe": {"config": cfg}}}).success
    assert seen == [[], ["extra_args", "tolerance"]]


def test_a_launch_the_engine_would_not_follow_a_schedule_with_is_refused_before_any_server_starts():
    """vLLM drops the schedule under data parallelism and drafts its largest k at every load: the sweep's arguments are
    refused naming it; the prefix cache's EAGLE block drop is said as a cost, at every k."""
    from pydantic import ValidationError

    from eagle3_assets.stages.load_curve import LoadCurveArgs

    args = {"target": "/t", "drafter": "/d", "prompts": "p.parquet", "out_dir": "o"}
    with pytest.raises(ValidationError) as e:
        LoadCurveArgs(**args, extra_args=["--enforce-eager", "--data-parallel-size", "2"])
    assert "--data-parallel-size 2 in extra_args: vLLM 0.32 drops num_speculative_tokens_per_batch_size" in str(e.value)
    LoadCurveArgs(**args, extra_args=["-dp=1"])
    assert "prefills up to 128 tokens more than on the target alone, at every k" in ss.launch_costs([], 128)[0]
    assert ss.launch_costs(["--no-enable-prefix-caching"], 128) == []
