"""Stage `load_curve`: one drafter's load curve on a real engine, and its speculation schedule by load.

A server per k (k = 0: the target alone, then each k from 1 to the deepest asked), the same launch settings. At each
concurrency of the grid every server serves the same requests in turn (a few batches each, the order rotating), so a
slow spell of the host falls on all of them alike; output tokens/s and time per output token per (k, concurrency).
The schedule is chosen from the rounds' ratios (eagle3_assets/common/spec_schedule.py: a k where its paired rounds
win beyond the noise, else off) and written in each engine's form (launch_files.py): `speculative_config.vllm.json`
and `adaptive.sglang.json` (for SGLang's `--speculative-adaptive --speculative-adaptive-config`; SGLang does not run
here)."""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from ...common import spec_schedule
from .. import engines
from ..compute_dtype import choice, host_device, line
from ..engines import load
from ..engines.server import EngineServer, free_port, serve_preflight
from ..errors import StageError
from ..files import atomic_file, require_file, resolve
from ..target.chat import first_turn_prompt
from ..target.model import load_tokenizer
from . import launch_files
from .bench import drive_in_turn, k0_plugin, start_together

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.load_curve import LoadCurveArgs

TURN = 1  # batches per server per turn at one concurrency: short turns, many of them, so that a slow spell of
# the host (seen: one server at 0.47x between two at 1.3x, in turns of 2 batches) spreads over every server


def batch_limit(extra: list[str], cap: int) -> tuple[int, int]:
    """(the grid's cap, the schedule's last batch size): --max-num-seqs from extra_args bounds both; without it
    the schedule runs to 1024, past every default of vLLM 0.32 (256, 1024 on large GPUs)."""
    seqs = None
    for i, a in enumerate(extra):
        if a.startswith("--max-num-seqs"):
            seqs = int(a.split("=", 1)[1] if "=" in a else extra[i + 1])
    return (min(cap, seqs) if seqs else cap), (seqs or 1024)


def run(workdir: str, args: LoadCurveArgs, reporter) -> None:
    engine = engines.get(args.engine)
    python = args.engine_python or sys.executable
    target, drafter = resolve(workdir, args.target), resolve(workdir, args.drafter)
    require_file(drafter / "config.json", "the drafter's export", "materialize drafter_export first")
    out_dir = resolve(workdir, args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = list(args.extra_args or [])
    cap, max_batch = batch_limit(extra, int(args.max_concurrency))
    grid = sorted({1, *(c for c in args.concurrencies if c <= cap)})
    ks = list(range(0, int(args.num_speculative_tokens) + 1))
    device = host_device()
    dtype_info = choice(args.dtype, device)
    info = serve_preflight(engine, python, target, dtype=dtype_info["dtype"], extra=extra)
    reporter.log(f"{engine.NAME} {info['version']}; {line(dtype_info)}; k {ks} at concurrencies {grid}")
    costs = spec_schedule.launch_costs(extra, 16 if device == "cuda" else 128)
    for cost in costs:
        reporter.log(cost, "warning")
    tok = load_tokenizer(target)
    rows = pq.read_table(require_file(resolve(workdir, args.prompts), "the prompts", "materialize them first"),
                         columns=["id", "messages"]).to_pylist()
    if not rows:
        raise StageError(f"{args.prompts} holds no prompts")
    prompts = [load.Request(r["id"], first_turn_prompt(tok, r["messages"])) for r in rows]
    common = dict(dtype=dtype_info["dtype"], max_model_len=int(args.max_model_len), seed=int(args.seed), extra=extra,
                  language_model_only=engine.text_only(target, info, args.language_model_only))
    env = {**engine.SERVER_ENV, **{str(k): str(v) for k, v in (args.env or {}).items()}}

    def server(k: int, taken: list[int]) -> EngineServer:
        argv = engine.server_command(python, str(target), free_port(taken), drafter=str(drafter) if k else None,
                                     k=max(k, 1), **common)
        return EngineServer(f"{engine.NAME} (k={k})", argv, int(argv[argv.index("--port") + 1]),
                            out_dir / f"server-k{k}.log", env=env, health=engine.HEALTH)

    together, why = start_together(args.start_servers, len(ks), target, env, device)
    reporter.log(why)
    t0 = time.monotonic()
    table: dict[int, dict[int, dict]] = {k: {} for k in ks}
    ratios: dict[int, dict[int, list[float]]] = {}  # each round's tokens/s over the target alone's, per k and c
    with ExitStack() as running:
        started: dict[int, EngineServer] = {}
        if together:
            t_start = time.monotonic()
            for k in ks:
                started[k] = running.enter_context(server(k, [s.port for s in started.values()]))
            for srv in started.values():
                srv.wait_ready(float(args.ready_timeout_s), reporter, since=t_start)
                load.drive(srv.base_url, "target", prompts[:1], 4, 1)
            for c in grid:
                got, rates = _in_turn(started, _requests(prompts, c, args), c, int(args.max_new_tokens))
                for k in ks:
                    table[k][c] = got[k]
                    ratios.setdefault(k, {})[c] = [r / b for r, b in zip(rates[k], rates[0]) if b]
                reporter.log(_point_line(c, table, ratios))
        else:  # a GPU host: one server at a time, the whole grid each
            alone: dict[int, dict[int, list[float]]] = {}
            for k in ks:
                srv = running.enter_context(server(k, []))
                srv.wait_ready(float(args.ready_timeout_s), reporter)
                load.drive(srv.base_url, "target", prompts[:1], 4, 1)
                for c in grid:
                    got, rates = _in_turn({k: srv}, _requests(prompts, c, args), c, int(args.max_new_tokens))
                    table[k][c], alone.setdefault(k, {})[c] = got[k], rates[k]
                srv.stop()
            for c in grid:  # rounds paired by their order, not in turn: a GPU's noise is a CPU's fraction
                for k in ks:
                    ratios.setdefault(k, {})[c] = [r / b for r, b in zip(alone[k][c], alone[0][c]) if b]
                reporter.log(_point_line(c, table, ratios))
    curve = {k: {c: table[k][c]["output_tokens_per_s"] for c in grid} for k in ks}
    tpot = {k: {c: table[k][c].get("tpot_ms_mean") for c in grid} for k in ks}
    meta = write_schedule(out_dir, str(drafter), curve, max_batch, float(args.tolerance), tpot,
                          {"engine": engine.NAME, "engine_version": info["version"], **dtype_info,
                           "k0_plugin": k0_plugin(engine, info), "rounds_in_turn": together, "launch_costs": costs,
                           "wall_s": round(time.monotonic() - t0, 1)}, rounds={k: r for k, r in ratios.items() if k})
    reporter.log(f"schedule: {meta['schedule_text']} ({meta['wall_s']:.0f} s)")
    reporter.materialize(metadata=meta)
    reporter.result(meta)


def write_schedule(out_dir: Path, drafter: str, curve: dict[int, dict[int, float]], max_batch: int, tolerance: float,
                   tpot: dict[int, dict[int, float | None]] | None, about: dict,
                   rounds: dict[int, dict[int, list[float]]] | None = None) -> dict:
    """The schedule chosen from a load curve ({k: {concurrency: output tokens/s}}, k = 0 the target alone), its
    launch files in each engine's form and load_curve.json written into `out_dir`; the metadata (with `about`: the
    engine, its version, the host's processor and dtype). Also the promotion gate's, from its own batches."""
    ks, grid = sorted(curve), sorted(curve[0])
    schedule, choice_rows = spec_schedule.choose(curve, max_batch=max_batch, tolerance=tolerance, rounds=rounds)
    files = launch_files.write(out_dir, drafter, schedule)
    for r in choice_rows:
        r["tpot_ms"] = {k: (tpot or {}).get(k, {}).get(r["concurrency"]) for k in ks}
    meta = {**about, "grid": grid, "ks": ks, "decision": "paired rounds: a k speculates where the lower quartile of "
            f"its rounds' ratios to the target alone is above 1 + {spec_schedule.WIN_MARGIN:g} (at least "
            f"{spec_schedule.MIN_ROUNDS} rounds), else off; off past the largest concurrency measured"
            if rounds is not None else "one figure a point (no rounds): the best tokens/s",
            "schedule": [list(r) for r in schedule], "schedule_text": spec_schedule.describe(schedule),
            "curve": {str(k): {str(c): v for c, v in row.items()} for k, row in curve.items()},
            "table": choice_rows, "max_batch": max_batch, "tolerance": tolerance,
            "path": str(out_dir), **files,
            "speedup_at_1": choice_rows[0]["speedup"], f"speedup_at_{grid[-1]}": choice_rows[-1]["speedup"]}
    with atomic_file(out_dir / "load_curve.json") as tmp:
        tmp.write_text(json.dumps(meta, indent=1, default=str))
    return meta


def _requests(prompts: list, c: int, args) -> list:
    """A batch of `c` per round: the prompts cycled, ids suffixed."""
    return [load.Request(f"{p.id}#{i}", p.prompt_token_ids) for i, p in
            ((i, prompts[i % len(prompts)]) for i in range(int(args.rounds) * c))]


def _in_turn(servers: dict, requests: list, c: int, max_new: int) -> tuple[dict[int, dict], dict[int, list[float]]]:
    """Every server on the same requests, one batch of `c` a round, the order rotating each round: each server's
    summary and its tokens/s in each round. Each server first serves one unmeasured batch at this concurrency: a CPU
    backend builds its kernels for a new batch shape on first use (one k = 2 server measured 0.47x at one request,
    where k = 1 and 3 measured 1.30x and 1.37x)."""
    keys = list(servers)
    for k in keys:
        load.drive(servers[k].base_url, "target", requests[:c], 8, c)
    size = TURN * c
    parts = [requests[i: i + size] for i in range(0, len(requests), size)]
    rates: dict = {}
    got = drive_in_turn(servers, parts, c, max_new, lambda k: f"the k={k} server at concurrency {c}", part_rates=rates)
    return {k: load.summarize(*got[k]) for k in keys}, rates


def _point_line(c: int, table: dict, ratios: dict) -> str:
    def ratio(k):
        s = spec_schedule.spread(ratios.get(k, {}).get(c, []))
        return f" ({s['median']:.2f}x, rounds {s['q1']:.2f}-{s['q3']:.2f})" if s["median"] else ""

    return f"concurrency {c}: " + ", ".join(f"k={k} {table[k][c]['output_tokens_per_s']:.1f} tok/s"
                                             + (ratio(k) if k else "") for k in sorted(table))
