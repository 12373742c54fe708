"""The integration gate, before any long training: a drafter that has memorised a handful of the
already-extracted conversations, exported as the real export, must be accepted almost entirely by the real
engine on exactly those prompts. If not, the engine's EAGLE-3 integration is broken for this target (the
story's 15 % after 2.6 hours), found in minutes.

- `integration_drafter`: run for an engine (the gate job's partition), that engine's preflight first, with
  integration_check's launch settings: a refusal that depends only on the target and the host is the gate's
  verdict before anything is trained. Then stage `integration_data` (the samples as a shard of their own,
  their prompts, and the parity of engine-extracted hidden states against transformers'), then the product's
  own `train`, `export` and `speculate` (the offline figure) on them.
- `integration_check` (per engine partition): parity first (a failure there names the layer, and no server
  starts), the export read back as the engine reads it against the trained checkpoint (stage `engine_check`),
  then the `serve_bench` stage (the benchmark's own server, load and counter code) on those prompts; on a
  failure, the offline replay on the export too, so that the verdict tells our export from the engine: the
  engine's acceptance length close to the offline figure and near the ceiling k + 1, or which side failed and
  what to look at, in order, with the evidence (serving.diagnosis). Its blocking check `integration_passes`
  is what eagle3_drafter waits on.
"""

import time

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..common.engines import NAMES
from ..common.launch import launch_facts
from ..hosts import GpuHost
from ..stages.integration_data import IntegrationDataSettings
from ..stages.serve_bench import ServeBenchSettings
from .partitions import engine_partitions, shard_partitions
from .paths import CONVERSATIONS, SHARDS_DIR, VOCAB
from .serving import diagnosis
from .upstream import upstream_metadata

GATE_DIR = "integration"
PASSES = "integration_passes"


class IntegrationDrafterConfig(dg.Config, IntegrationDataSettings):
    """How the gate's drafter memorises its samples (the train stage's settings of that name), and how it is
    measured offline. On SmolLM2-135M, 60 steps over 3 samples with 12-token replies gave an offline acceptance
    length of 3.0 (k + 1 = 4), and vLLM's the same."""

    epochs: int = Field(default=60, gt=0, description="passes over the samples (a step per sample at these sizes)")
    lr: float = Field(default=3e-3, gt=0)
    ttt_steps: int = Field(default=3, gt=0, description="training-time-test unroll: at least the draft length served")
    row_tokens: int = Field(default=512, gt=0, description="tokens per packed row (a whole sample each)")
    num_speculative_tokens: int = Field(default=3, gt=0, description="draft length, offline and served")
    max_new_tokens: int = Field(default=64, gt=0, description="per prompt, offline and served (at most the shortest "
                                "memorised reply)")
    dtype: str | None = Field(default=None, description="offline decoding's dtype (speculate's)")


class IntegrationCheckConfig(dg.Config, ServeBenchSettings):
    """The served half: serve_bench's launch settings (baseline, concurrencies, limit and lengths are the
    gate's own), and what passes."""

    # Measured on SmolLM2 (3 samples, 12-token replies, k 3): correct 3.000 of offline 3.000; aux ids shifted by one
    # 2.769 (0.92: neighbouring layers of a residual stream are alike, so a memorised drafter still lands most)
    min_ratio_to_offline: float = Field(default=0.95, ge=0, le=1, description="the engine's acceptance length "
                                        "must be at least this share of the memorised drafter's offline one (the same "
                                        "drafter on the same prompts: a correct integration measures the same)")
    min_share_of_ceiling: float = Field(default=0.7, ge=0, le=1, description="... and at least this share of the "
                                        "ceiling k + 1 (offline too: else the drafter has not memorised its samples; "
                                        "replies shorter than a few drafts cannot reach k + 1)")


@dg.asset(group_name="integration", kinds={"pytorch"}, pool="gpu_host",
          deps=["hidden_state_shards", "conversations", "vocab_mapping", "target_model"],
          code_version=code_version(__name__, "integration_drafter"))
def integration_drafter(context: dg.AssetExecutionContext, config: IntegrationDrafterConfig,
                        gpu_host: GpuHost) -> dg.MaterializeResult:
    """A drafter memorising a handful of the extracted conversations, exported for every engine, with its
    offline acceptance on their prompts; and the hidden-state parity of engine-extracted shards."""
    target = upstream_metadata(context, "target_model")["path"]
    times, t0 = {}, time.monotonic()
    engine = context.run.tags.get("dagster/partition")  # the gate job's engine; none when materialized alone
    if engine in NAMES:
        launch = _check_launch(context.run.run_config)
        check = gpu_host.run_stage(context, "engine_check", {
            "engine": engine, "purpose": "serve", "target": target, "refuse": False, **launch}).result
        if check.get("refusal"):  # the target and the host decide it: nothing trained, exported or served
            return dg.MaterializeResult(metadata={
                "preflight_engine": engine, "preflight_refusal": _gate_refusal(check),
                "wall_s": round(time.monotonic() - t0, 1)})
    keys = context.instance.get_dynamic_partitions(shard_partitions.name)
    done = context.instance.get_materialized_partitions(dg.AssetKey("hidden_state_shards"))
    first = next((k for k in keys if k in done), None)
    if first is None:
        raise dg.Failure(description="no hidden_state_shards partition is materialized: the gate memorises "
                                     "already-extracted conversations; materialize one shard first")
    data = gpu_host.run_stage(context, "integration_data", {
        "target": target, "shards": [f"{SHARDS_DIR}/shard-{first}"], "conversations": CONVERSATIONS,
        "out": f"{GATE_DIR}/data", "samples": config.samples, "parity_samples": config.parity_samples}).result
    times["data_s"] = round(time.monotonic() - t0, 1)
    parity = data.get("parity") or "not checked: the shards came from the hf backend (the reference itself)"
    parity_passed = (data.get("parity") or {}).get("passed", True)
    common = {"samples": data["samples"], "tokens": data["tokens"], "prompts": data["prompts"], "shard": data["shard"],
              "shards_backend": data["backend"], "parity": parity, "parity_passed": parity_passed}
    if not parity_passed:  # a drafter trained on those states cannot work: the gate fails on parity alone
        return dg.MaterializeResult(metadata={**common, **times, "wall_s": round(time.monotonic() - t0, 1)})
    # served past the memorised replies, the target says what no sample taught: the ceiling no longer holds
    max_new = min(config.max_new_tokens, int(data["reply_tokens"]))
    t = time.monotonic()
    train = gpu_host.run_stage(context, "train", {
        "target": target, "shards": [data["shard"]], "vocab": VOCAB, "out": f"{GATE_DIR}/drafter",
        "epochs": config.epochs, "lr": config.lr, "ttt_steps": config.ttt_steps, "row_tokens": config.row_tokens,
        "rows_per_batch": 1, "warmup_ratio": 0.0, "probe_batches": 0, "resume": False})
    times["train_s"] = round(time.monotonic() - t, 1)
    trained = train.materialization.metadata if train.materialization else {}
    t = time.monotonic()
    export = gpu_host.run_stage(context, "export", {"drafter": train.result["path"], "target": target,
                                                    "out": f"{GATE_DIR}/export"}).result
    times["export_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    offline = gpu_host.run_stage(context, "speculate", {
        "target": target, "drafter": train.result["path"], "prompts": data["prompts"], "limit": data["samples"],
        "num_speculative_tokens": config.num_speculative_tokens, "max_new_tokens": max_new,
        "dtype": config.dtype}).result
    times["offline_s"] = round(time.monotonic() - t, 1)
    meta = {
        **common, "drafter": train.result["path"], "train_steps": train.result["steps"],
        "train_final_loss_0": (train.result.get("loss") or [None])[0],
        "train_acc_0": (train.result.get("acc") or [None])[0],
        "train_wall_s": train.result["wall_s"], "source": export["source"],
        **{k: v for k, v in export.items() if k.endswith(("_path", "_left_out"))},
        "offline_acceptance_length": offline["acceptance_length"], "offline_dtype": config.dtype or "auto",
        "num_speculative_tokens": config.num_speculative_tokens, "max_new_tokens": max_new,
        **times, "wall_s": round(time.monotonic() - t0, 1),
        "train_tokens_per_s": trained.get("tokens_per_s").value if "tokens_per_s" in trained else None,
    }
    return dg.MaterializeResult(metadata=meta, data_version=dg.DataVersion(str(export.get("data_version"))))


def _check_launch(run_config: dict) -> dict:
    """integration_check's launch settings in this run (its defaults where unset): the preflight before
    training asks about the server the gate will start."""
    cfg = IntegrationCheckConfig(**((run_config.get("ops") or {}).get("integration_check") or {}).get("config", {}))
    return {"dtype": cfg.dtype, "extra_args": list(cfg.extra_args), "engine_python": cfg.engine_python}


def _gate_refusal(check: dict) -> str:
    """The engine's refusal, and the way on: for an MLA target on a CPU host no fix of the target passes."""
    if check.get("cpu_mla"):
        return (f"{check['refusal']}\n\nOn this host without a GPU no MLA target can pass the integration gate: the "
                "engines' CPU builds cannot serve it an EAGLE-3 drafter. To train anyway, set integration_gate: skip "
                "in eagle3_drafter's config (or EAGLE3_INTEGRATION_GATE=skip), or run the gate on a GPU host")
    return (f"{check['refusal']}\n\nFix what it names and run the gate again, or set integration_gate: skip in "
            "eagle3_drafter's config to train without it")


def _parity_failure(parity: dict) -> str:
    rows = [f"{name}: norm ratio {v['norm_ratio']:.4f}, cosine {v['cosine']:.4f}" + (" (all zero)" if v["all_zero"]
                                                                                      else "")
            for name, v in parity["layers"].items() if not v["passed"]]
    tol = parity["tolerance"]
    return (f"hidden-state parity failed: the engine-extracted shards disagree with the transformers forward on the "
            f"same tokens at {', '.join(parity['failed_layers'])} ({'; '.join(rows)}; tolerance for a "
            f"{parity['kind']} target: norm ratio within {tol['max_norm_ratio_error']:.0%} of 1, mean cosine >= "
            f"{tol['min_cosine']}). The engine captures other, scaled or empty states than the target computes: "
            f"a drafter trained on them cannot work. Check the engine's capture for this architecture (all zero: "
            f"not wired; a constant ratio: a scale applied on one side only), then re-extract the shards")


def before_serving(engine: str, drafter: dict, config: IntegrationCheckConfig) -> tuple[str | None, dict]:
    """What fails the gate before any server starts (why, or None), and the facts so far: the hidden-state
    parity, then whether the drafter memorised its samples at all."""
    facts = {}
    if drafter.get("preflight_refusal") and drafter.get("preflight_engine") == engine:
        return f"the gate refused before training its drafter: {drafter['preflight_refusal']}", facts
    parity = drafter.get("parity")
    if isinstance(parity, dict):
        facts.update({f"parity_{n.replace(' ', '_')}_{m}": v[m] for n, v in parity["layers"].items()
                      for m in ("norm_ratio", "cosine")})
        if not parity["passed"]:
            return _parity_failure(parity), facts
    ceiling, offline_al = int(drafter["num_speculative_tokens"]) + 1, float(drafter["offline_acceptance_length"])
    facts.update(offline_acceptance_length=round(offline_al, 4), ceiling=ceiling)
    if offline_al < config.min_share_of_ceiling * ceiling:
        return (f"the gate's drafter did not memorise its samples: offline acceptance length {offline_al:.3f} of a "
                f"ceiling of {ceiling} (needs {config.min_share_of_ceiling:.0%}); nothing can be told about {engine} "
                "from it. Raise integration_drafter's epochs or lr"), facts
    return None, facts


def config_differences(diff: list[dict] | None) -> str:
    """engine_check's export_config_diff as one line: "rope_theta: export 100000.0, checkpoint 10000.0; ..."."""
    return "; ".join(f"{d['key']}: export {d['export']}, checkpoint {d['checkpoint']}" for d in diff or [])


def _export_side(engine: str, offline_al: float, sides: dict, config: IntegrationCheckConfig) -> str | None:
    """Our side of a failure, or None: the export differs from the trained drafter as the engine reads it
    (tensor by tensor), or the offline replay on the export falls short of the one on the checkpoint; with the
    fields where the export's config.json differs from the checkpoint's, when any do."""
    readback, export_al = sides.get("export_readback"), sides.get("export_offline_acceptance_length")
    replay = (f"; the offline replay on the export gives acceptance length {export_al:.3f} against {offline_al:.3f} "
              "on the trained checkpoint" if export_al is not None else "")
    refused = sides.get("export_offline_error")
    replay += f"; our offline replay refuses the export: {refused}" if refused else ""
    fields = config_differences(sides.get("export_config_diff"))
    differs = f". Its config.json differs from the checkpoint's: {fields}" if fields else ""
    if readback and not readback["same"]:
        return (f"the export differs from the trained drafter at {readback['tensor']}: {readback['why']}{replay}"
                f"{differs}. Our exporter's bug, not {engine}'s: inspect how write_export "
                f"(eagle3_assets/worker/serving/export.py) writes {readback['tensor']}, then rematerialize "
                "integration_drafter")
    if refused:
        return (f"our own offline replay refuses the export, so it is not the trained drafter as served: "
                f"{refused}{differs}. Our exporter's bug, not {engine}'s (or the export was changed after it was "
                "written): inspect write_export (eagle3_assets/worker/serving/export.py), then rematerialize "
                "integration_drafter")
    if export_al is not None and export_al < config.min_ratio_to_offline * offline_al:
        where = (f"its config makes another drafter: {fields} (the export's config.json against the checkpoint's)"
                 if fields else "its config makes another drafter (aux layer ids, vocab mapping, norms), though no "
                 "field of its config.json differs from the checkpoint's but as the exporter writes them")
        return (f"the export's tensors are the trained drafter's, but the offline replay on the export gives "
                f"acceptance length {export_al:.3f} against {offline_al:.3f} on the trained checkpoint: {where}. "
                f"Our exporter's bug, not {engine}'s (or the export was changed after it was written): inspect how "
                "write_export (eagle3_assets/worker/serving/export.py) writes "
                + (", ".join(d["key"] for d in sides["export_config_diff"]) if fields else "config.json")
                + ", then rematerialize integration_drafter")
    return None


def verdict(engine: str, drafter: dict, served: dict | None, error: str | None, config: IntegrationCheckConfig,
            extra_args: list[str], sides: dict | None = None) -> tuple[bool, str, dict]:
    """(passed, description, facts) for one engine: what fails before serving, then which side a failure is on
    (`sides`: the export read back against the checkpoint, the offline replay on the export), then the served
    acceptance against the offline figure and the ceiling, with serving.diagnosis's ordered, evidenced list."""
    early, facts = before_serving(engine, drafter, config)
    if early is not None:
        return False, early, facts
    sides = sides or {}
    ceiling, offline_al = facts["ceiling"], facts["offline_acceptance_length"]
    readback = sides.get("export_readback")
    if readback is not None:
        facts["export_readback"] = "same" if readback["same"] else f"differs at {readback['tensor']}: {readback['why']}"
    if sides.get("export_config_diff") is not None:
        facts["export_config_diff"] = config_differences(sides["export_config_diff"]) or "none"
    if sides.get("export_offline_acceptance_length") is not None:
        facts["export_offline_acceptance_length"] = round(float(sides["export_offline_acceptance_length"]), 4)
    ours = _export_side(engine, offline_al, sides, config)
    fields = config_differences(sides.get("export_config_diff"))
    theirs = ("the export is the trained drafter (tensor by tensor as the engine reads it"
              + (f", and the offline replay on it gives {facts['export_offline_acceptance_length']:.3f} as the "
                 "checkpoint's" if "export_offline_acceptance_length" in facts else "")
              + (f"; its config.json differs from the checkpoint's: {fields}" if fields else "")
              + "); the engine serves something else: ") if readback and ours is None else ""
    if served is None:
        evidence = {**launch_facts(extra_args), "engine": engine}
        facts.update({k_: str(v) for k_, v in evidence.items()})
        if ours is not None:
            return False, f"{ours}. Besides, {engine} did not serve it: {error}\n\n{diagnosis(evidence)}", facts
        return False, (f"{engine} did not serve the gate's memorised drafter: {error}\n\n{diagnosis(evidence)}"), facts
    engine_al = served.get("acceptance_length")
    facts.update({"engine_acceptance_length": round(engine_al, 4) if engine_al else None,
                  **{k_: str(served.get(k_)) for k_ in ("served_aux_layers", "trained_aux_layers", "served_method",
                                                        "attention_backend", "draft_vocab_mapping",
                                                        "dropped_config_keys")}})
    if ours is not None:
        measured = f"{engine} acceptance length {engine_al:.3f}" if engine_al else f"{engine} counted no drafts"
        return False, f"{ours}. ({measured}, offline {offline_al:.3f}.)\n\n{diagnosis(served)}", facts
    if engine_al is None:
        return False, f"{theirs}{engine} reported no acceptance (no drafts counted).\n\n{diagnosis(served)}", facts
    ratio = engine_al / offline_al
    facts["ratio_to_offline"] = round(ratio, 4)
    if ratio >= config.min_ratio_to_offline and engine_al >= config.min_share_of_ceiling * ceiling:
        return True, (f"{engine} accepts the memorised drafter's drafts: acceptance length {engine_al:.3f}, offline "
                      f"{offline_al:.3f}, ceiling {ceiling}"), facts
    return False, (f"{theirs}{engine} acceptance length {engine_al:.3f} on the samples the drafter memorised is "
                   f"{ratio:.0%} of its offline {offline_al:.3f} (ceiling {ceiling}): the engine's EAGLE-3 "
                   f"integration is broken for this target, not the drafter. {diagnosis(served)}"), facts


def failed_after_serving(served: dict | None, drafter: dict, config: IntegrationCheckConfig) -> bool:
    """Whether the served figure fails the gate (then the offline replay on the export says whose side)."""
    al, offline_al = (served or {}).get("acceptance_length"), float(drafter["offline_acceptance_length"])
    ceiling = int(drafter["num_speculative_tokens"]) + 1
    return not al or al < config.min_ratio_to_offline * offline_al or al < config.min_share_of_ceiling * ceiling


@dg.asset(group_name="integration", kinds={"python"}, partitions_def=engine_partitions, pool="gpu_host",
          deps=["integration_drafter", "target_model"], code_version=code_version(__name__, "integration_check"),
          check_specs=[dg.AssetCheckSpec(PASSES, asset="integration_check", blocking=True,
                                         description="the engine accepts nearly all drafts of a drafter that memorised "
                                                     "the prompts it serves: its EAGLE-3 integration works")])
def integration_check(context: dg.AssetExecutionContext, config: IntegrationCheckConfig, gpu_host: GpuHost):
    """The gate's memorised drafter served by the engine (partition) on exactly its samples' prompts, measured
    by the engine's own counters, against its offline figure: pass, or fail naming what to look at."""
    engine = context.partition_key
    drafter = upstream_metadata(context, "integration_drafter")
    t0, served, error = time.monotonic(), None, None
    early, _ = before_serving(engine, drafter, config)
    if early is None and f"{engine}_path" not in drafter:
        raise dg.Failure(description=f"integration_drafter has no {engine} export: "
                                     f"{drafter.get(f'{engine}_left_out') or 'rematerialize it'}")
    target = upstream_metadata(context, "target_model")["path"]
    sides: dict = {}
    if early is None:  # the launch refused, and the export read back as the engine reads it, before a server
        check = gpu_host.run_stage(context, "engine_check", {
            "engine": engine, "purpose": "serve", "target": target, "refuse": False,
            "drafter": drafter[f"{engine}_path"], "trained_drafter": drafter["source"],
            "dtype": config.dtype, "extra_args": list(config.extra_args), "engine_python": config.engine_python}).result
        sides["export_readback"] = check.get("export_readback")
        sides["export_config_diff"] = check.get("export_config_diff")
        if check.get("refusal"):
            error = f"the preflight refused it: {_gate_refusal(check)}"
    if early is None and error is None:
        try:
            run = gpu_host.run_stage(context, "serve_bench", {
                "engine": engine, "target": target,
                "drafter": drafter[f"{engine}_path"], "trained_drafter": drafter["source"],
                "prompts": drafter["prompts"], "prompt_set": "integration", "checkpoint": "integration",
                "history": f"{GATE_DIR}/{engine}/history.parquet",
                "out_dir": f"{GATE_DIR}/{engine}/{time.strftime('%Y%m%d-%H%M%S')}",
                **config.model_dump(exclude={"min_ratio_to_offline", "min_share_of_ceiling"}),
                "limit": drafter["samples"], "max_new_tokens": drafter["max_new_tokens"],
                "num_speculative_tokens": drafter["num_speculative_tokens"], "concurrencies": [1],
                "baseline": False})
            served = run.result["metadata"]
        except dg.Failure as e:  # the server never served: a verdict too (the method trap dies at start)
            error = e.description
    readback = sides.get("export_readback")
    if early is None and ((served is not None and failed_after_serving(served, drafter, config))
                          or (readback and not readback["same"])):
        # our own speculative decoding on the export as served: the same figure as on the checkpoint, or not; an
        # export our own replay refuses (a d2t not a mapping, say) is evidence of our side too, not the gate's end
        try:
            sides["export_offline_acceptance_length"] = gpu_host.run_stage(context, "speculate", {
                "target": target, "drafter": drafter[f"{engine}_path"], "prompts": drafter["prompts"],
                "limit": drafter["samples"], "num_speculative_tokens": drafter["num_speculative_tokens"],
                "max_new_tokens": drafter["max_new_tokens"],
                "dtype": None if drafter.get("offline_dtype", "auto") == "auto" else drafter["offline_dtype"],
            }).result["acceptance_length"]
        except dg.Failure as e:
            sides["export_offline_error"] = (e.description or "").split("\n")[0]
    passed, why, facts = verdict(engine, drafter, served, error, config, list(config.extra_args), sides)
    serve_s = round(time.monotonic() - t0, 1)
    meta = {"passed": passed, "verdict": dg.MetadataValue.md(why), **facts, "serve_s": serve_s, "run_id": context.run_id,
            "gate_wall_s": round(float(drafter.get("wall_s") or 0) + serve_s, 1),
            "drafter_wall_s": drafter.get("wall_s"), "train_s": drafter.get("train_s")}
    (context.log.info if passed else context.log.error)(f"integration gate {engine}: {why}")
    return dg.MaterializeResult(metadata=meta, check_results=[dg.AssetCheckResult(
        check_name=PASSES, passed=passed, metadata={k: v for k, v in facts.items() if v is not None},
        description=why)])


def gate_state(instance: dg.DagsterInstance, engine: str) -> tuple[bool | None, str]:
    """The latest integration_check of `engine`: (passed, why); passed None when it has not run."""
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("integration_check"), asset_partitions=[engine]), limit=1).records
    if not recs:
        return None, f"integration_check has not run for {engine}"
    meta = recs[0].event_log_entry.asset_materialization.metadata
    verdict_text = meta["verdict"].value if "verdict" in meta else ""
    return bool(meta["passed"].value), verdict_text
