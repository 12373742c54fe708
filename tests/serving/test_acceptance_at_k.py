"""Offline acceptance at every draft length, and the engine held against it at the k the engine served (issue 58,
section 5: a schedule serving k = 2 at one request was compared with offline's k = 3). On the shipped base drafter
of the embedded SmolLM2, finetuned one short epoch by the graph: a drafter whose drafts land three in a row, so
that the figures at k = 1, 2 and 3 differ. No engine runs here: the benchmark's figures are the offline ones, at
the k a served benchmark records (`acceptance_k`); tests/serving/test_vllm.py holds vLLM's to them."""

from __future__ import annotations

import dagster as dg
import pytest

from conftest import speculate_metadata

FINETUNE = {"init_from": "shipped:smollm2-135m-instruct", "epochs": 1, "lr": 1e-5, "ttt_steps": 3, "row_tokens": 48,
            "rows_per_batch": 1, "warmup_ratio": 0.0, "run_name": "shipped-k"}
OFFLINE = {"limit": 4, "max_new_tokens": 24}  # the eval prompts, k = 3 (the default)


@pytest.fixture(scope="module")
def shipped(built):
    built.materialize("eagle3_drafter", "offline_acceptance", config={"eagle3_drafter": {"config": FINETUNE},
                                                                      "offline_acceptance": {"config": OFFLINE}})
    return built


def test_one_replay_gives_every_shorter_k_its_own_figures(shipped):
    """The replay at k = 3 also measures k = 1 and 2, each on its own trajectory (a step accepting both drafts at
    k = 2 moves on where k = 3 would have drafted a third): its figures at each k equal a replay run at that k."""
    top = shipped.latest("offline_acceptance")
    assert top["num_speculative_tokens"] == 3 and top["acceptance_ks"] == [1, 2, 3]
    assert top["acceptance_at_pos_2_k3"] > 0, top  # steps of three accepted drafts: k = 2's trajectory is another
    assert top["acceptance_length_k1"] < top["acceptance_length_k2"] < top["acceptance_length_k3"], top
    assert top["acceptance_length_k3"] == top["acceptance_length"]
    for k in (1, 2):
        alone = speculate_metadata(shipped, prompts="prompts/eval.parquet", **OFFLINE, num_speculative_tokens=k)
        assert alone["acceptance_ks"] == list(range(1, k + 1))
        assert top[f"acceptance_length_k{k}"] == alone["acceptance_length"], (k, top, alone)
        assert [top[f"acceptance_at_pos_{i}_k{k}"] for i in range(k)] == \
            [alone[f"acceptance_at_pos_{i}"] for i in range(k)], (k, top, alone)


def test_the_engine_is_held_against_offline_acceptance_at_the_k_it_served(shipped):
    """The user's run: a schedule serving k = 2 at one request, offline_acceptance at k = 3. The check compares with
    offline's figure at k = 2: the engine matching it passes at a ratio of 1, a quarter of it lost fails, and a k
    offline did not measure warns, saying how to measure it."""
    from eagle3_assets.assets.serving import ServingBenchmarkConfig, consistency

    ev = shipped.instance.get_latest_materialization_event(dg.AssetKey("offline_acceptance")).asset_materialization
    offline = {k: v.value for k, v in ev.metadata.items()}
    ctx = dg.build_asset_context(instance=shipped.instance)
    bench = {"engine": "vllm", "checkpoint": ev.tags["dagster/input_data_version/eagle3_drafter"],
             "num_speculative_tokens": 3, "schedule": [[1, 1, 2], [2, 256, 3]], "acceptance_k": 2}
    at2 = offline["acceptance_length_k2"]
    same = consistency(ctx, {**bench, "acceptance_length": at2}, ServingBenchmarkConfig())
    assert same.passed, same.description
    facts = {k: v.value for k, v in same.metadata.items()}
    assert facts["offline_acceptance_length"] == at2 != offline["acceptance_length_k3"], facts  # k = 2's, not 3's
    assert facts["ratio"] == 1.0 and facts["k"] == 2, facts
    lost = consistency(ctx, {**bench, "acceptance_length": 0.75 * at2}, ServingBenchmarkConfig())
    assert not lost.passed and lost.severity == dg.AssetCheckSeverity.ERROR
    assert f"at k = 2 is 75% of the offline reference {at2:.3f} at the same k" in lost.description, lost.description
    deeper = consistency(ctx, {**bench, "num_speculative_tokens": 4, "schedule": None, "acceptance_k": 4,
                               "acceptance_length": at2}, ServingBenchmarkConfig())
    assert not deeper.passed and deeper.severity == dg.AssetCheckSeverity.WARN
    assert "materialize offline_acceptance with num_speculative_tokens >= 4" in deeper.description
