"""Stage `serve_compare`: drafters side by side in one engine, the promotion gate's measurement. Each drafter (and
the target alone, for the speedup) gets a server with the same launch settings, started one after the other (or
together on a CPU host whose memory holds them, as serve_bench does); each is warmed up, then measured on every
prompt set one request at a time: acceptance from the engine's own counters, output tokens/s. With a load mix, the
first set (the gate's traffic) is measured again at each of its concurrencies, and that set's speedup is the mix's
(eagle3_assets/common/load_mix.py): the production's load, not one request alone. The figures come back as
{label: {set: figures}}, with the speedup over the baseline on the same set."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from ...common import load_mix
from .. import engines
from ..compute_dtype import choice, host_device, line
from ..engines import load
from ..engines.server import EngineServer, free_port, serve_preflight
from ..errors import StageError
from ..files import require_file, resolve
from ..target.chat import first_turn_prompt
from ..target.model import load_tokenizer
from .bench import measure_in_turn, start_together
from .load_curve import batch_limit, write_schedule

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.serve_compare import ServeCompareArgs

PARTS = 3  # batches of `c` requests each server serves at least, in turn when the servers run together (bench.measure_in_turn)
BASELINE = "baseline"
TOLERANCE = 0.03  # the load_curve stage's default: a k kept from the concurrency below while within 3 %


def run(workdir: str, args: ServeCompareArgs, reporter) -> None:
    engine = engines.get(args.engine)
    python = args.engine_python or sys.executable
    target = resolve(workdir, args.target)
    drafters = {label: resolve(workdir, d) for label, d in args.drafters.items()}
    for label, d in drafters.items():
        require_file(d / "config.json", f"the {label} drafter's export", "materialize its export first")
    if BASELINE in drafters:
        raise StageError(f"a drafter may not be labelled {BASELINE!r}: that is the server without speculation")
    if args.schedule_of and (args.schedule_of not in drafters or not args.schedule_dir):  # before any server starts
        raise StageError(f"schedule_of {args.schedule_of!r} names no drafter here ({', '.join(drafters)}), or no "
                         "schedule_dir: name one of the drafters and where its schedule goes")
    out_dir = resolve(workdir, args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = host_device()
    dtype_info = choice(args.dtype, device)
    info = serve_preflight(engine, python, target, dtype=dtype_info["dtype"], extra=list(args.extra_args or []))
    reporter.log(f"{engine.NAME} {info['version']}; {line(dtype_info)}")
    tok = load_tokenizer(target)
    sets = {}
    for name, path in args.prompt_sets.items():
        rows = pq.read_table(require_file(resolve(workdir, path), f"prompt set {name}", "materialize it first"),
                             columns=["id", "messages"]).to_pylist()[: int(args.limit or 10**9)]
        if not rows:
            raise StageError(f"prompt set {name} ({path}) holds no prompts")
        sets[name] = [load.Request(r["id"], first_turn_prompt(tok, r["messages"])) for r in rows]
    k, max_new, c = int(args.num_speculative_tokens), int(args.max_new_tokens), int(args.concurrencies[0])
    common = dict(k=k, dtype=dtype_info["dtype"], max_model_len=int(args.max_model_len), seed=int(args.seed),
                  extra=list(args.extra_args or []), language_model_only=engine.text_only(target, info,
                                                                                        args.language_model_only))
    env = {**engine.SERVER_ENV, **{str(k_): str(v) for k_, v in (args.env or {}).items()}}
    labels = [*drafters, *([BASELINE] if args.baseline else [])]
    mix = load_mix.check(args.load_mix) if args.load_mix else None
    mix_set = next(iter(sets))
    # the mix's concurrencies not measured already; without the target alone there is no speedup to weigh
    more = sorted(set(mix or {}) - {c}) if args.baseline else []
    if mix and not args.baseline:
        reporter.log("load mix given but no baseline server: nothing to weigh, measured at the first concurrency only")
        mix = None
    if mix:
        reporter.log(f"load mix: {load_mix.describe(mix)}" + (f"; {mix_set} also measured at {', '.join(map(str, more))}"
                                                              if more else ""))
    at: dict[str, dict[int, float]] = {label: {} for label in labels}  # tokens/s on the mix's set, by concurrency
    paired: dict[str, dict] = {label: {} for label in labels}  # (set, c) -> speedup from parts served in turn

    def server(label: str, taken: list[int]) -> EngineServer:
        argv = engine.server_command(python, str(target), free_port(taken),
                                     drafter=str(drafters[label]) if label != BASELINE else None, **common)
        return EngineServer(f"{engine.NAME} ({label})", argv, int(argv[argv.index("--port") + 1]),
                            out_dir / f"server-{label}.log", env=env, health=engine.HEALTH)

    together, why = start_together(args.start_servers, len(labels), target, env, device)
    reporter.log(why)
    figures: dict[str, dict] = {}
    t0 = time.monotonic()

    def warm(srv: EngineServer) -> None:
        if engine.WARM_UP:
            load.drive(srv.base_url, "target", next(iter(sets.values()))[:1], 4, 1)

    with ExitStack() as running:
        if together:
            started: dict[str, EngineServer] = {}
            t_start = time.monotonic()
            for label in labels:
                started[label] = running.enter_context(server(label, [s.port for s in started.values()]))
            for srv in started.values():
                srv.wait_ready(float(args.ready_timeout_s), reporter, since=t_start)
                warm(srv)
            reporter.log(f"measuring the {len(labels)} servers in turn, a batch of {c} requests each at a time")
            for name, requests in sets.items():
                for label, got in measure_in_turn(engine, started, requests, c, max_new, k, reporter, PARTS,
                                                  BASELINE)[0].items():
                    _keep(figures, label, name, got, reporter)
                    paired[label][(name, c)] = got.get("paired_speedup")
            for level in more:
                for label, got in measure_in_turn(engine, started, sets[mix_set], level, max_new, k, reporter,
                                                  PARTS, BASELINE, acceptance=False)[0].items():
                    at[label][level] = got["output_tokens_per_s"]
                    paired[label][(mix_set, level)] = got.get("paired_speedup")
        else:
            for label in labels:
                srv = running.enter_context(server(label, []))
                srv.wait_ready(float(args.ready_timeout_s), reporter)
                warm(srv)
                for name, requests in sets.items():
                    got = measure_in_turn(engine, {label: srv}, requests, c, max_new, k, reporter, PARTS, None,
                                          acceptance=label != BASELINE)[0][label]
                    _keep(figures, label, name, got, reporter)
                for level in more:
                    got = measure_in_turn(engine, {label: srv}, sets[mix_set], level, max_new, k, reporter, PARTS,
                                          None, acceptance=False)[0][label]
                    at[label][level] = got["output_tokens_per_s"]
                srv.stop()
    if mix:  # every server's tokens/s on the mix's set by concurrency, the first pass's at c
        for label in labels:
            got = {c: figures[label][mix_set]["output_tokens_per_s"], **at[label]}
            figures[label][mix_set]["tokens_per_s_by_concurrency"] = {str(x): got[x] for x in sorted(got)}
    if args.baseline:
        for label in drafters:
            for name in sets:
                base = figures[BASELINE][name]["output_tokens_per_s"]
                mine = figures[label][name]["output_tokens_per_s"]
                figures[label][name]["speedup"] = paired[label].get((name, c)) or (
                    round(mine / base, 4) if base and mine else None)
            if mix:
                _at_mix(figures[label][mix_set], figures[BASELINE][mix_set], mix, label, reporter,
                        {x: v for (name, x), v in paired[label].items() if name == mix_set and v})
    about = {"engine": engine.NAME, "engine_version": info["version"], **dtype_info}
    sched, no_sched = schedule_from_batches(args, workdir, drafters, figures, mix_set, c, k, about, reporter)
    meta = {**about, "num_speculative_tokens": k,
            "max_new_tokens": max_new, "concurrency": c, "figures": figures,
            **({"load_mix": {str(x): v for x, v in mix.items()}, "load_mix_set": mix_set} if mix else {}),
            "path": str(out_dir),
            "wall_s": round(time.monotonic() - t0, 1),
            **{f"{label}_{name}_{key}": v for label, per in figures.items() for name, f in per.items()
               for key, v in f.items() if key in ("acceptance_length", "speedup") and v is not None},
            **({"schedule_from_batches": sched} if sched else {}),
            **({"no_schedule_from_batches": no_sched} if no_sched else {})}
    reporter.materialize(metadata=meta)
    reporter.result(meta)


def schedule_from_batches(args, workdir: str, drafters: dict, figures: dict, mix_set: str, c: int, k: int,
                          about: dict, reporter) -> tuple[dict | None, str | None]:
    """The schedule of the drafter labelled `schedule_of`, from the batches served here: on the first set, the target
    alone's tokens/s at each concurrency measured and the drafter's (the baseline's times its paired speedup there),
    its k against none; written as the load_curve stage writes a sweep's. No server starts for it: a sweep measures
    every k up to the deepest on a grid of its own, this only the gate's concurrencies and the served k. Returns
    (its metadata, None), or (None, why there is none): the gate's verdict stands without one."""
    label = args.schedule_of
    if not label:
        return None, None

    def none(why: str) -> tuple[None, str]:
        reporter.log(f"no schedule from these batches: {why}")
        return None, why

    if not args.baseline:
        return none("the target alone (baseline) was not measured")
    base, mine = figures[BASELINE][mix_set], figures[label][mix_set]
    base_tok = {int(x): v for x, v in (base.get("tokens_per_s_by_concurrency")
                                       or {str(c): base["output_tokens_per_s"]}).items()}
    speedup = {int(x): v for x, v in (mine.get("speedup_by_concurrency") or {str(c): mine.get("speedup")}).items()}
    if 1 not in base_tok:  # a schedule starts at one request alone
        return none(f"measured at {sorted(base_tok)} requests, not one alone: add 1 to the gate's concurrencies, or "
                    "let challenger_schedule sweep (source: sweep)")
    if missing := [x for x in sorted(base_tok) if not (base_tok.get(x) and speedup.get(x))]:
        return none(f"no throughput or speedup at {missing} requests (speedups {speedup}): challenger_schedule's "
                    "sweep (source: sweep) measures its own")
    curve = {0: base_tok, k: {x: base_tok[x] * speedup[x] for x in base_tok}}
    out = resolve(workdir, args.schedule_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        _, max_batch = batch_limit(list(args.extra_args or []), 1 << 30)
        meta = write_schedule(out, str(drafters[label]), curve, max_batch, TOLERANCE, None,
                              {**about, "measured_by": "the promotion gate's batches (serve_compare), at its "
                                                       f"concurrencies and k={k}: no sweep"})
    except (StageError, ValueError) as e:  # ScheduleError is a ValueError: the verdict stands, the reason is kept
        return none(str(e))
    reporter.log(f"{label}'s schedule from these batches: {meta['schedule_text']}")
    return meta, None


def _keep(figures: dict, label: str, name: str, got: dict, reporter) -> None:
    figures.setdefault(label, {})[name] = {key: got.get(key) for key in (
        "acceptance_length", "acceptance_per_pos", "output_tokens_per_s", "requests")}
    if got.get("paired_spread"):  # the speedup's spread over the rounds: the gate's noise
        figures[label][name]["speedup_spread"] = got["paired_spread"]
    reporter.log(f"{label} on {name}: acceptance length {got.get('acceptance_length')}, "
                 f"{got.get('output_tokens_per_s')} tokens/s")


def _at_mix(mine: dict, base: dict, mix: dict, label: str, reporter, paired: dict[int, float]) -> None:
    """The set's speedup at the mix, and by concurrency, into `mine`; the speedup at the first concurrency kept.
    Where the servers ran in turn, the speedup at a concurrency is the paired one, and the mix weighs the tokens/s
    it implies (the baseline's times it), so the speedups by concurrency and at the mix agree."""
    tok, base_tok = ({int(x): v for x, v in f["tokens_per_s_by_concurrency"].items()} for f in (mine, base))
    tok = {x: base_tok[x] * paired[x] if x in paired and base_tok.get(x) else v for x, v in tok.items()}
    mine["speedup_by_concurrency"] = {str(x): round(tok[x] / base_tok[x], 4) if tok[x] and base_tok.get(x) else None
                                      for x in sorted(tok)}
    mine["speedup_at_first_concurrency"] = mine.get("speedup")
    got = load_mix.speedup(mix, tok, base_tok)
    mine["speedup"] = round(got, 4) if got is not None else None
    reporter.log(f"{label}: speedup {mine['speedup']} at the load mix ({load_mix.describe(mix)}); by concurrency "
                 + ", ".join(f"{x}: {v}x" for x, v in mine["speedup_by_concurrency"].items()))
