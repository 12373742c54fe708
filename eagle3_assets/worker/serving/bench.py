"""Stage `serve_bench`: the drafter served by a real engine (one of worker/engines/) on the host, against the
same server without speculation.

1. Preflight: the engine installed in `engine_python` is asked, from its own code, whether it can serve
   EAGLE-3 for this target's architecture; if not, fail before any server starts.
2. Per mode (EAGLE-3, then baseline): start the server, wait for health (with a timeout; the log's tail on
   failure), warm it up with one request, drive the eval prompts at each concurrency (streaming, greedy),
   read acceptance from the engine itself, stop the server and its whole process group. On a CPU host the
   servers start together and are measured one at a time (`start_together`); on a GPU one after the other.
3. Figures per concurrency: output tokens/s, TTFT, TPOT, acceptance length/rate/per position, speedup;
   one row per measurement appended to a Parquet history; greedy outputs compared with the baseline.

The history is read before any server starts. One that cannot be read is moved aside as
`<name>.corrupt-<time>` (bytes untouched) and a new one started, with a warning in the log and in the
metadata: it is a convenience copy on the host (Dagster's records hold every result, and benchmark_history
rebuilds from them), so failing every later (nightly) benchmark over it would lose measurements, not save any.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common import spec_schedule
from ...common.launch import launch_facts, launch_file
from .. import engines
from ..engines import load
from ..engines.server import EngineServer, free_port, serve_preflight
from ..errors import StageError
from ..files import atomic_file, quarantine, require_file, resolve
from ..target.chat import first_turn_prompt
from ..target.model import load_tokenizer
from . import launch_files

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.serve_bench import ServeBenchArgs


def layer_wiring(engine_name: str, export_dir: Path, trained_dir: Path | None, target: Path) -> dict:
    """Which target layers the engine will feed the draft (read from the export as served, in our
    output-of-layer convention) and which the drafter was trained on: the first thing to compare when
    acceptance collapses."""
    from ..target.model import load_config, text_config
    from ..training.checkpoint import aux_ids_from_config
    from .export import engine_capture_layers

    tc = text_config(load_config(target))  # a wrapper's (Kimi's) text model
    layers = int(tc.num_hidden_layers)
    served = engine_capture_layers(engine_name, json.loads((export_dir / "config.json").read_text()), layers,
                                   tc.model_type)
    out = {"served_aux_layers": served}
    if trained_dir is not None and (trained_dir / "config.json").exists():
        trained = json.loads((trained_dir / "config.json").read_text())
        out["trained_aux_layers"] = aux_ids_from_config(trained, layers, tc.model_type)
        served_cfg = json.loads((export_dir / "config.json").read_text())
        # what the conversion dropped or changed (layer-id fields aside: compared above, in one convention)
        out["dropped_config_keys"] = sorted(k for k in trained if k not in served_cfg and k != "eagle3_assets")  # ours
        out["changed_config_keys"] = sorted(k for k in trained if k in served_cfg and served_cfg[k] != trained[k]
                                            and "layer_ids" not in k)
        out["draft_vocab_mapping"] = _vocab_mapping(export_dir, trained_dir)
    return out


def _vocab_mapping(export_dir: Path, trained_dir: Path) -> str:
    """Whether the served d2t/t2d are the trained drafter's: "same", or what differs."""
    import torch
    from safetensors import safe_open

    def read(d: Path) -> dict:
        found = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                found.update({k: h.get_tensor(k) for k in ("d2t", "t2d") if k in h.keys()})
        return found

    served, trained = read(export_dir), read(trained_dir)
    differ = [k for k in ("d2t", "t2d") if k in trained and (k not in served or served[k].shape != trained[k].shape
                                                            or not torch.equal(served[k], trained[k]))]
    return "same" if not differ else "the served " + " and ".join(differ) + " differ from the trained drafter's"


def start_together(choice: str, n: int, target: Path, env: dict, device: str) -> tuple[bool, str]:
    """Whether the benchmark's `n` servers start at once, and why, in a log line. On a CPU a server's start is
    mostly Python imports, on one core each: started together on a 2-core AVX2-only EPYC, vLLM's EAGLE-3 and
    baseline servers (SmolLM2-135M, float32) were ready in 57 s instead of 70 + 68, and measured the same tokens/s
    and acceptance one at a time while the other idled. GPU servers each take most of the GPU's memory."""
    if n < 2 or choice == "one_at_a_time":
        return False, f"starting the {n} server(s) one at a time"
    if choice == "together":
        return True, f"starting the {n} servers together, measuring them one at a time (start_servers: together)"
    if device != "cpu":
        return False, f"starting the {n} servers one at a time (a GPU host: each takes most of a GPU's memory)"
    weights = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    # each: its KV cache, the weights upcast to float32 at worst, ~1.5 GiB of Python, torch and the engine
    need = n * (float(env.get("VLLM_CPU_KVCACHE_SPACE", 4)) * 2**30 + 2 * weights + 1.5 * 2**30)
    free = available_memory()
    if free is not None and free < need:
        return False, (f"starting the {n} servers one at a time: together they would need ~{need / 2**30:.1f} GiB, "
                       f"{free / 2**30:.1f} GiB is available")
    return True, f"starting the {n} servers together on this CPU host (their starts are mostly imports, a core each), " \
                 "measuring them one at a time while the others idle"


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def k0_plugin(engine, info: dict) -> str:
    """Whether the engine's k = 0 steps are free here (vLLM: the k=0 plugin, worker/engines/vllm/k0_plugin.py), from
    its support probe's facts: in the log and metadata, so a figure says which path its k = 0 steps took."""
    state = getattr(engine, "k0_plugin_state", None)
    return state(info) if state else f"none for {engine.NAME}: its k = 0 steps run its own path"


def drive_in_turn(servers: dict, parts: list[list], c: int, max_new: int, name, on_part=None,
                  part_rates: dict | None = None) -> dict:
    """Every server on each part of the requests in turn, `c` in flight, the order rotating each part, so that a slow
    spell of the host falls on all of them alike: {key: (responses, wall seconds)}. A failed request stops it,
    naming the server (`name(key)`) and, where it died, why. `part_rates`, where given, gets each server's output
    tokens/s on every part, in order: {key: [rate, ...]}."""
    keys = list(servers)
    got = {key: ([], 0.0) for key in keys}
    for t, part in enumerate(parts):
        for key in keys[t % len(keys):] + keys[: t % len(keys)]:
            responses, wall = load.drive(servers[key].base_url, "target", part, max_new, c)
            failed = [x for x in responses if x.error]
            if failed:
                why = servers[key].died(wait_s=10)
                raise StageError(f"{len(failed)}/{len(responses)} requests to {name(key)} failed, first: "
                                 f"{failed[0].error}" + (f"\n{why}" if why else ""))
            got[key] = (got[key][0] + responses, got[key][1] + wall)
            if part_rates is not None:
                part_rates.setdefault(key, []).append(sum(x.output_tokens for x in responses) / wall if wall else 0.0)
        if on_part:
            on_part(t)
    return got


def paired(rates: list[float], base_rates: list[float]) -> dict:
    """A server's speedup over the baseline from batches both served back to back (drive_in_turn's part_rates): the
    spread (spec_schedule.spread: median, quartiles, rounds) of the per-batch ratios. A stall of the host (a
    sensor's tick, a kernel built on first use of a shape) that falls on one server's batch moves one ratio, not the
    figure; over the batches' sum it once read a challenger 27 % better in acceptance at 0.54x the target alone, its
    champion at 1.00x."""
    return spec_schedule.spread([r / b for r, b in zip(rates, base_rates, strict=True) if r and b])


def paired_speedup(rates: list[float], base_rates: list[float]) -> float | None:
    """The median of `paired`: the speedup figure."""
    return paired(rates, base_rates)["median"]


def at_load(requests: list, c: int, batches: int = 2) -> list:
    """The eval prompts, repeated (ids suffixed) to at least `batches` times the concurrency: a concurrency of 16
    measured on 8 prompts would never have more than 8 in flight. The lowest concurrency's figures, on the prompts
    as given, stay the ones compared with offline_acceptance."""
    if len(requests) >= batches * c:
        return requests
    return [load.Request(f"{r.id}#{i // len(requests)}" if i >= len(requests) else r.id, r.prompt_token_ids)
            for i, r in ((i, requests[i % len(requests)]) for i in range(batches * c))]


def measure_in_turn(engine, servers: dict, requests: list, c: int, max_new: int, k: int, reporter, rounds: int,
                    baseline: str | None, acceptance: bool = True) -> tuple[dict[str, dict], dict, dict]:
    """Every server on the same requests, `c` at a time in turn, the order rotating each round (at least `rounds`
    batches): a slow spell of the host (the daemon's sensor ticks, other work) falls on one server's batch, and a
    server's speedup is the median of its batches' ratios to the `baseline` server's (paired_speedup; the quartiles
    in paired_spread), not the sums' ratio. Each server first serves one unmeasured batch at this concurrency: a CPU
    backend builds its kernels for a new batch shape on first use. Measured one after the other on 2 shared cores,
    the same drafter ran 22 % slower than its champion at the same acceptance length. Returns each server's figures,
    its responses and its tokens/s batch by batch."""
    requests = at_load(requests, c, rounds)  # a median needs rounds
    for srv in servers.values():
        if engine.WARM_UP:  # not where the engine counts acceptance from its start (SGLang)
            _served(srv, load.drive(srv.base_url, "target", requests[:c], 8, c)[0], "its warm-up batch")
    try:
        before = {label: engine.measure_start(srv) for label, srv in servers.items()
                  if acceptance and label != baseline}
    except OSError as e:
        dead = next((why for srv in servers.values() if (why := srv.died(wait_s=10))), "")
        raise StageError(f"reading the engine's counters before measuring at {c} failed: {e}\n{dead}".strip()) from None
    parts = [requests[i: i + c] for i in range(0, len(requests), c)]
    rates: dict[str, list[float]] = {}
    got = drive_in_turn(servers, parts, c, max_new, lambda label: servers[label].name, part_rates=rates,
                        on_part=lambda r: reporter.log(f"c={c}: {min(len(requests), (r + 1) * c)}/{len(requests)} "
                                                       "requests on each server") if (r + 1) % 4 == 0 else None)
    out = {}
    for label in servers:
        out[label] = load.summarize(*got[label])
        if label in before:
            out[label].update(engine.acceptance(servers[label], before[label], k))
        if label != baseline and baseline in rates:
            spread = paired(rates[label], rates[baseline])
            out[label].update(paired_speedup=spread["median"], paired_spread=spread)
            reporter.log(f"{servers[label].name} at {c} at once: {spread['median']}x the {servers[baseline].name}, "
                         f"the median of {spread['rounds']} rounds' ratios (quartiles {spread['q1']}-{spread['q3']})")
    return out, {label: got[label][0] for label in servers}, rates


def _served(server: EngineServer, responses: list, what: str) -> None:
    if failed := [r for r in responses if r.error]:
        why = server.died(wait_s=10)
        raise StageError(f"{len(failed)}/{len(responses)} requests to {server.name} failed ({what}), first: "
                         f"{failed[0].error}" + (f"\n{why}" if why else ""))


def run(workdir: str, args: ServeBenchArgs, reporter) -> None:
    engine = engines.get(args.engine)
    python = args.engine_python or sys.executable
    target = resolve(workdir, args.target)
    drafter = resolve(workdir, args.drafter)
    prompts_path = require_file(resolve(workdir, args.prompts), "eval prompts", "materialize the prompts asset first")
    k, max_new = int(args.num_speculative_tokens), int(args.max_new_tokens)
    schedule = args.schedule
    if schedule:  # k per batch size: acceptance is counted over the deepest k the schedule drafts
        k = max(r[2] for r in schedule) or k
    concurrencies = [int(c) for c in args.concurrencies]
    out_dir = resolve(workdir, args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    history = resolve(workdir, args.history)
    moved: list[str] = []
    read_history(history, reporter, moved)  # in seconds, before any server: not after every measurement

    from ..compute_dtype import choice, host_device, line

    device = host_device()
    dtype_info = choice(args.dtype, device)
    t0 = time.monotonic()
    from .export import left_out

    trained = resolve(workdir, args.trained_drafter) if args.trained_drafter else None
    info = serve_preflight(engine, python, target, dtype=dtype_info["dtype"], extra=list(args.extra_args or []),
                           unavailable=left_out(engine.NAME, target, trained))
    reporter.log(f"{engine.NAME} {info['version']} serves EAGLE-3 for {info['architecture']} "
                 f"({info.get('model_class', '?')}); checked in {time.monotonic() - t0:.1f} s")
    text_only = engine.text_only(target, info, args.language_model_only)
    tok = load_tokenizer(target)
    rows = pq.read_table(prompts_path).to_pylist()[: int(args.limit or 10**9)]
    if not rows:
        raise StageError(f"{prompts_path} holds no prompts")
    requests = [load.Request(r["id"], first_turn_prompt(tok, r["messages"])) for r in rows]
    env = {**engine.SERVER_ENV, **{str(k_): str(v) for k_, v in (args.env or {}).items()}}
    reporter.log(line(dtype_info))
    common = dict(k=k, dtype=dtype_info["dtype"], max_model_len=int(args.max_model_len),
                  seed=int(args.seed), extra=list(args.extra_args or []), language_model_only=text_only)
    timeout = float(args.ready_timeout_s)

    plans = [("eagle3", levels) for levels in engine.server_plan(concurrencies)]
    if args.baseline:
        plans.append(("baseline", concurrencies))

    def server(mode: str, levels: list[int], taken: list[int]) -> EngineServer:
        argv = engine.server_command(python, str(target), free_port(taken), drafter=str(drafter)
                                     if mode == "eagle3" else None, **common,
                                     **({"schedule": schedule} if schedule and mode == "eagle3" else {}))
        return EngineServer(f"{engine.NAME} ({mode})", argv, int(argv[argv.index("--port") + 1]),
                            out_dir / f"server-{mode}-c{'-'.join(map(str, levels))}.log", env=env, health=engine.HEALTH)

    together, why = start_together(args.start_servers, len(plans), target, env, device)
    reporter.log(why)
    results: dict[tuple[str, int], dict] = {}
    texts: dict[str, dict[str, str]] = {}
    # rounds pair the drafter's server with the baseline; alone, more batches would serve prompts again (fewer than
    # rounds x c of them), and a prompt served again hits the prefix cache, where vLLM drops EAGLE's first block
    rounds = int(args.rounds) if args.baseline else 2

    def keep(mode: str, c: int, figures: dict, responses: list, ready: float) -> None:
        figures["server_ready_s"] = round(ready, 1)
        results[(mode, c)] = figures
        if c == min(concurrencies):
            texts[mode] = {r.id: r.text for r in responses}
        _write_requests(out_dir / f"requests-{mode}-c{c}.jsonl", responses)

    facts = launch_facts(server("eagle3", plans[0][1], []).argv)
    with ExitStack() as running:
        if together:  # every concurrency in paired rounds: the drafter's server and the baseline in turn
            t_start, started, ready = time.monotonic(), [], {}
            for mode, levels in plans:
                srv = running.enter_context(server(mode, levels, [s.port for s in started]))
                started.append(srv)
                reporter.log(f"starting {srv.name}: {' '.join(srv.argv[1:])}")
            for srv in started:  # all started at t_start: each one's ready time counts from it
                ready[srv.name] = srv.wait_ready(timeout, reporter, since=t_start)
            reporter.log(f"{len(started)} servers ready after {time.monotonic() - t_start:.0f} s; measuring them in "
                         f"turn, at least {rounds} batches of each concurrency")
            for c in concurrencies:
                turn = {mode: srv for (mode, levels), srv in zip(plans, started) if c in levels}
                got, responses, _ = measure_in_turn(engine, turn, requests, c, max_new, k, reporter, rounds,
                                                    "baseline" if args.baseline else None)
                for mode in turn:
                    keep(mode, c, got[mode], responses[mode], ready[turn[mode].name])
        else:  # a GPU host: one server at a time, its batches paired with the other's by their order
            rates: dict[tuple[str, int], list[float]] = {}
            for mode, levels in plans:
                srv = running.enter_context(server(mode, levels, []))
                reporter.log(f"starting {srv.name}: {' '.join(srv.argv[1:])}")
                ready_s = srv.wait_ready(timeout, reporter)
                reporter.log(f"{srv.name} ready after {ready_s:.0f} s")
                for c in levels:
                    got, responses, batch_rates = measure_in_turn(engine, {mode: srv}, requests, c, max_new, k,
                                                                  reporter, rounds, None, acceptance=mode == "eagle3")
                    rates[(mode, c)] = batch_rates[mode]
                    keep(mode, c, got[mode], responses[mode], ready_s)
                srv.stop()
            for c in concurrencies:
                if ("baseline", c) in rates:
                    spread = paired(rates[("eagle3", c)], rates[("baseline", c)])
                    results[("eagle3", c)].update(paired_speedup=spread["median"], paired_spread=spread)

    summary = _summary(engine, info, results, texts, concurrencies, k, args)
    summary["metadata"].update(dtype_info, language_model_only=text_only, k0_plugin=k0_plugin(engine, info), **facts)
    if schedule:
        summary["metadata"].update(schedule=schedule, schedule_text=spec_schedule.describe([tuple(r) for r in schedule]))
        if args.verify is not None:
            summary["metadata"].update(_verify(engine, args, results, str(drafter), reporter))
    summary["metadata"].update(layer_wiring(engine.NAME, drafter, resolve(workdir, args.trained_drafter)
                                            if args.trained_drafter else None, target))
    append_history(history, summary["rows"], reporter, moved)
    meta = summary["metadata"]
    if moved:
        meta["history_moved_aside"] = moved
    meta.update(path=str(out_dir), prompts=str(prompts_path), wall_s=round(time.monotonic() - t0, 1))
    version = hashlib.sha256(json.dumps(summary["rows"], sort_keys=True, default=str).encode()).hexdigest()[:32]
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({"metadata": meta, "rows": summary["rows"]})


def _verify(engine, args: ServeBenchArgs, results: dict, drafter: str, reporter) -> dict:
    """The sweep's choice against the scheduled server's paired rounds (spec_schedule.verify), said in the log; where
    the schedule falls back to off somewhere, the schedule so changed and its launch files rewritten beside the
    drafter (what the rollout and a team's `vllm serve` start with)."""
    sweep = args.verify
    measured = {c: f["paired_spread"] for (mode, c), f in results.items() if mode == "eagle3" and f.get("paired_spread")}
    rows, off = spec_schedule.verify(sweep.table, measured, sweep.tolerance)
    for r in rows:
        reporter.log(f"verification at {r['concurrency']}: k={r['k']} {r['verified_speedup']:.3f}x (rounds "
                     f"{r['verified_q1']:.2f}-{r['verified_q3']:.2f}) against the sweep's {r['sweep_speedup']:.3f}x: "
                     + ("agrees" if r["agrees"] else f"below it by more than {sweep.tolerance:.0%}")
                     + ("; falls back to off there" if r["falls_back_to_off"] else ""),
                     "warning" if r["falls_back_to_off"] or not r["agrees"] else "info")
    meta = {"verification": rows, "verification_agrees": all(r["agrees"] for r in rows),
            "verification_tolerance": sweep.tolerance}
    if not off:
        return meta
    chosen = [(r["concurrency"], 0 if r["concurrency"] in off else r["k"]) for r in sweep.table]
    verified = spec_schedule.from_points(chosen, sweep.max_batch)
    files = launch_files.write(launch_file(drafter, engine.NAME).parent, drafter, verified)
    text = spec_schedule.describe(verified)
    reporter.log(f"the schedule falls back to off at {sorted(off)}: {text}; its launch files rewritten "
                 f"({', '.join(files.values())})", "warning")
    return {**meta, "verified_schedule": [list(r) for r in verified], "verified_schedule_text": text,
            "fell_back_at": sorted(off), "launch_files": files}


def _write_requests(path: Path, responses: list) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps({"id": r.id, "output_tokens": r.output_tokens, "ttft_s": r.ttft_s,
                                           "latency_s": r.latency_s, "text": r.text}) + "\n" for r in responses))


def _summary(engine, info, results, texts, concurrencies, k, args) -> dict:
    rows, meta = [], {"engine": engine.NAME, "engine_version": info["version"], "num_speculative_tokens": k,
                      "checkpoint": args.checkpoint, "prompt_set": args.prompt_set,
                      "max_new_tokens": int(args.max_new_tokens), "requests": None}
    for c in concurrencies:
        spec, base = results.get(("eagle3", c), {}), results.get(("baseline", c))
        meta["requests"] = spec.get("requests")
        # paired rounds' median where the servers ran in turn; the sums' ratio for a benchmark without rounds
        speedup = spec.get("paired_speedup") or (spec["output_tokens_per_s"] / base["output_tokens_per_s"]
                                                 if base and base["output_tokens_per_s"] else None)
        spread = spec.get("paired_spread") or {}
        row = {"engine": engine.NAME, "engine_version": info["version"], "checkpoint": args.checkpoint,
               "prompt_set": args.prompt_set, "num_speculative_tokens": k, "concurrency": c,
               "max_new_tokens": int(args.max_new_tokens), "requests": spec.get("requests"),
               "acceptance_length": spec.get("acceptance_length"), "acceptance_rate": spec.get("acceptance_rate"),
               "acceptance_per_pos": spec.get("acceptance_per_pos"),
               "output_tokens_per_s": spec.get("output_tokens_per_s"),
               "baseline_output_tokens_per_s": base["output_tokens_per_s"] if base else None,
               "speedup": round(speedup, 4) if speedup else None,
               "ttft_ms_mean": spec.get("ttft_ms_mean"), "tpot_ms_mean": spec.get("tpot_ms_mean"),
               "baseline_tpot_ms_mean": base["tpot_ms_mean"] if base else None,
               "measured_at": time.time()}
        rows.append(row)
        for key in ("acceptance_length", "acceptance_rate", "output_tokens_per_s", "baseline_output_tokens_per_s",
                    "speedup", "ttft_ms_mean", "tpot_ms_mean"):
            if row[key] is not None:
                meta[f"{key}_c{c}"] = round(float(row[key]), 4)
        for i, p in enumerate(row["acceptance_per_pos"] or []):
            meta[f"acceptance_pos{i}_c{c}"] = round(p, 4)
        if spread.get("rounds"):  # the speedup's spread over the paired rounds
            meta.update({f"speedup_q1_c{c}": spread["q1"], f"speedup_q3_c{c}": spread["q3"],
                         f"speedup_rounds_c{c}": spread["rounds"]})
    first = rows[0]
    meta["acceptance_length"] = first["acceptance_length"]  # at the lowest concurrency: the headline figure
    meta.update(_acceptance_k(args.schedule, first["concurrency"], k))
    meta["acceptance_per_pos"] = first["acceptance_per_pos"]
    meta["speedup"] = first["speedup"]
    if "baseline" in texts and "eagle3" in texts:
        same = sum(texts["eagle3"][i] == texts["baseline"].get(i) for i in texts["eagle3"])
        meta["greedy_outputs_identical"] = same == len(texts["eagle3"])
        meta["greedy_outputs_matching"] = f"{same}/{len(texts['eagle3'])}"
    return {"rows": rows, "metadata": meta}


def _acceptance_k(schedule, c: int, k: int) -> dict:
    """The draft length the headline acceptance was counted at (concurrency c): k, or with a schedule the k it
    drafts at batch sizes 1 to c (offline_acceptance's figure at that k is the one to compare with). Where the
    schedule's k changes within 1..c, the figure mixes them: acceptance_k is None, acceptance_k_mixed says which."""
    if not schedule:
        return {"acceptance_k": k}
    ks = sorted({spec_schedule.k_at([tuple(r) for r in schedule], b) for b in range(1, c + 1)})
    return {"acceptance_k": ks[0]} if len(ks) == 1 else {"acceptance_k": None, "acceptance_k_mixed": ks}


def _set_aside(path: Path, why: str, reporter, moved: list[str]) -> None:
    kept = quarantine(path)
    moved.append(str(kept))
    reporter.log(f"benchmark history {path} {why}: moved aside to {kept} (unchanged, to inspect or repair) and "
                 "starting a new history; every result is also in Dagster's records (benchmark_history)", "warning")


def read_history(path: Path, reporter, moved: list[str]) -> pa.Table | None:
    """The history so far (None: none yet); an unreadable one is set aside (see the module's docstring)."""
    if not path.exists():
        return None
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        _set_aside(path, f"cannot be read ({type(e).__name__}: {e})", reporter, moved)
        return None


def append_history(path: Path, rows: list[dict], reporter, moved: list[str]) -> None:
    """One row per measurement, appended (read + write a new file + rename: never a torn history)."""
    table = pa.Table.from_pylist(rows)
    old = read_history(path, reporter, moved)
    if old is not None:
        try:
            table = pa.concat_tables([old, table], promote_options="permissive")
        except pa.ArrowException as e:  # a column whose type changed: keep both, never drop the new rows
            _set_aside(path, f"has columns of other types than this result ({e})", reporter, moved)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
