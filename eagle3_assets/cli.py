"""`eagle3-assets materialize`: the whole graph that exists, on the embedded default or a run-config
file, recorded in the Dagster instance at $DAGSTER_HOME (so the UI and later runs see it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

from .common.engines import DEFAULT, NAMES
from .common.secrets import scrub

QUIET_LOGGERS = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
EMBEDDED_DEADLINE_S = 870.0  # the preset's 15 minutes on 2 cores, less half a minute of margin


def _instance():
    if not os.environ.get("DAGSTER_HOME"):
        home = Path.cwd() / "dagster_home"
        if not (home / "dagster.yaml").exists():
            sys.exit("DAGSTER_HOME is not set and ./dagster_home/dagster.yaml does not exist: run from the "
                     "project root or `export DAGSTER_HOME=/abs/path/to/dagster_home`")
        os.environ["DAGSTER_HOME"] = str(home.resolve())
    from dagster import DagsterInstance

    return DagsterInstance.get()


def _ops_config(run_config: dict, assets: list[str]) -> dict:
    ops = run_config.get("ops", {})
    return {**QUIET_LOGGERS, "ops": {a: ops[a] for a in assets if a in ops}}


def embedded_preset(name: str = "embedded_cpu.yaml") -> dict:
    """A shipped preset's run config: `embedded_cpu.yaml`, the main command's with no --config (sized to end
    within 15 minutes on 2 cores; its training time budget adapts the epochs to the CPU), or
    `embedded_cpu_full.yaml`, the whole recipe."""
    from importlib import resources

    import yaml

    return yaml.safe_load(resources.files("eagle3_assets").joinpath(f"presets/{name}").read_text())


def materialize(args) -> int:
    warnings.filterwarnings("ignore", message=".*(preview|beta).*", category=Warning)
    instance = _instance()
    import dagster as dg
    import yaml

    from .assets.partitions import shard_partitions
    from .definitions import PREPARE_DATA, TRAIN_DRAFTER, defs

    if args.config:
        run_config = yaml.safe_load(Path(args.config).read_text()) or {}
    else:
        run_config = embedded_preset()
        print("==> no --config: using the embedded-default preset embedded_cpu.yaml (15 minutes on 2 cores; each "
              "stage picks bfloat16 or float32 from the host's CPU and logs which)", flush=True)
    deadline = args.deadline if args.deadline is not None else (None if args.config else EMBEDDED_DEADLINE_S)
    t0, started = time.monotonic(), time.time()

    def run(job: str, assets: list[str], partition: str | None = None, label: str = "") -> bool:
        print(f"==> {label or job}: {', '.join(assets)}", flush=True)
        res = defs.resolve_job_def(job).execute_in_process(
            instance=instance, partition_key=partition, raise_on_error=False,
            run_config=_ops_config(run_config, assets))
        print(f"    ({time.monotonic() - t0:.0f} s since the start)", flush=True)
        if not res.success:
            print(f"{label or job} failed (run {res.run_id}): its log in the Dagster UI says why; after fixing, "
                  "rematerialize just that asset or partition", file=sys.stderr)
        return res.success

    print(f"==> instance: {os.environ['DAGSTER_HOME']}", flush=True)
    if not run("check_host", ["host_preflight"]) or not run("prepare_data", PREPARE_DATA):
        return 1
    keys = instance.get_dynamic_partitions(shard_partitions.name)
    for i, key in enumerate(keys, 1):
        if not run("extract_hidden_states", ["hidden_state_shards"], key, f"hidden_state_shards {key} ({i}/{len(keys)})"):
            return 1
    if not _integration_gate(instance, run_config, run):  # before training: its time counts against the deadline
        return 1
    if deadline is not None:
        _fit_training(instance, run_config, deadline, time.monotonic() - t0)
    if not run("train_drafter", TRAIN_DRAFTER):
        return 1
    export = instance.get_latest_materialization_event(dg.AssetKey("drafter_export"))
    if export is not None:  # the figure the recipe's time budget is about: data to a servable drafter
        print(f"==> from the start to a servable drafter (drafter_export): {export.timestamp - started:.0f} s",
              flush=True)
    # production serves many requests at once: the schedule by load ships with the drafter, and the benchmark
    # verifies it at every concurrency of its grid (serving_benchmark's schedule: auto)
    if not run("measure_schedule", ["speculation_schedule"], DEFAULT, f"speculation_schedule {DEFAULT}"):
        return 1
    _print_schedule(instance, DEFAULT)
    if not run("benchmark_serving", ["serving_benchmark"], DEFAULT, f"serving_benchmark {DEFAULT}"):
        return 1
    took = time.monotonic() - t0
    print(f"==> done in {took:.0f} s" + (f" (deadline {deadline:.0f} s{', exceeded' if took > deadline else ''})"
                                         if deadline is not None else "")
          + f": {len(keys)} shards; open the UI with `dagster dev -w workspace.yaml`", flush=True)
    return 0


def _print_schedule(instance, engine: str) -> None:
    """The load curve's headline: the schedule, and speculation's speedup alone and at the highest load measured."""
    import dagster as dg

    recs = instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("speculation_schedule"), asset_partitions=[engine]), limit=1).records
    if recs:
        m = {k: v.value for k, v in recs[0].event_log_entry.asset_materialization.metadata.items()}
        first, last, deepest = m["table"][0], m["table"][-1], max(m["ks"])
        fixed = last[f"k{deepest}_tok_s"] / last["k0_tok_s"]
        print(f"==> speculation schedule {engine}: {m['schedule_text']}; {first['speedup']:.2f}x the target alone at 1 "
              f"request, {last['speedup']:.2f}x at {last['concurrency']} at once (a fixed k={deepest}: {fixed:.2f}x "
              f"there); measured in {m['wall_s']:.0f} s", flush=True)


def _integration_gate(instance, run_config: dict, run) -> bool:
    """The integration gate for the default engine, unless the drafter's config (or the environment) skips it:
    False, with its verdict printed, when it failed."""
    from .assets.drafter import GATE_ENV
    from .assets.integration import gate_state

    cfg = run_config.get("ops", {}).get("eagle3_drafter", {}).get("config", {})
    if (cfg.get("integration_gate") or os.environ.get(GATE_ENV) or "require") == "skip":
        print("==> integration gate skipped (integration_gate: skip)", flush=True)
        return True
    engine = cfg.get("integration_engine", DEFAULT)
    ran = run("integration_gate", ["integration_drafter", "integration_check"], engine, f"integration gate {engine}")
    passed, why = gate_state(instance, engine)  # a failed gate fails its run too (a blocking check): say why
    if not ran and passed:  # an older verdict: this run failed before giving one
        return False
    print(f"==> integration gate {engine}: {'passed' if passed else 'FAILED'}: {why}", flush=True)
    return bool(passed)


def _fit_training(instance, run_config: dict, deadline: float, elapsed: float) -> None:
    """Set the drafter's training time budget so that the command ends by the deadline (deadline.py)."""
    import dagster as dg

    from .deadline import training_budget

    conv = instance.get_latest_materialization_event(dg.AssetKey("conversations"))
    ready = conv.asset_materialization.metadata.get("server_ready_s") if conv is not None else None
    cfg = run_config.setdefault("ops", {}).setdefault("eagle3_drafter", {}).setdefault("config", {})
    budget, why = training_budget(deadline, elapsed, cfg.get("time_budget_s"), ready.value if ready else None)
    cfg["time_budget_s"] = budget
    print(f"==> training time budget {budget:g} s: {why}", flush=True)


def _per_position(stored: str | None) -> str:
    """Per-position acceptance as the table shows it: three decimals, as the AL column."""
    values = json.loads(stored) if stored else None
    return "-" if not values else "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def show_lineage(args) -> int:
    """The benchmark history, one line per result, and the lineage behind one of them (--explain N); with --served,
    per production server the drafter it serves, that drafter's benchmarks, live figures and drift reports."""
    instance = _instance()
    if args.served:
        from .eye.served_lineage import show_served

        try:
            return show_served(instance, args.engine)
        except ValueError as e:  # a bad servers file: its message names the field
            print(f"lineage --served: {e}", file=sys.stderr)
            return 2
    from . import lineage

    rows = lineage.history(instance)
    if args.engine:
        rows = [r for r in rows if r["engine"] == args.engine]
    if not rows:
        print("no serving_benchmark results in this instance yet: materialize serving_benchmark first")
        return 0
    if args.explain is not None and not 0 <= args.explain < len(rows):
        which = f" for {args.engine}" if args.engine else ""
        print(f"--explain {args.explain}: no such result; the history{which} has {len(rows)} "
              f"(numbered 0 to {len(rows) - 1}, as listed by `eagle3-assets lineage`)", file=sys.stderr)
        return 2
    print(f"{'#':>3}  {'when':19}  {'engine':7} {'version':9} {'checkpoint':12}  {'AL':>6}  {'speedup':>7}  per position")
    for i, r in enumerate(rows):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["when"]))
        al = f"{r['acceptance_length']:.3f}" if r["acceptance_length"] is not None else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        print(f"{i:>3}  {when}  {r['engine']:7} {str(r['engine_version']):9} {str(r['checkpoint'])[:12]:12}  {al:>6}  "
              f"{sp:>7}  {_per_position(r['acceptance_per_pos'])}")
    if args.explain is not None:
        r = rows[args.explain]
        print(f"\nresult #{args.explain} (run {r['run_id']}): checkpoint {r['checkpoint']}")
        print(f"  training config: {r['training_config']}")
        print(f"  benchmark settings: {r['settings']}")
        print(f"  {'serving_benchmark':20} {'':32}  code {r['serving_benchmark_code_version']}")
        for asset in lineage.CHAIN:
            print(f"  {asset:20} {str(r[f'{asset}_version']):32}  code {r[f'{asset}_code_version']}")
        if args.explain > 0:
            print("  against the previous result: " + "; ".join(lineage.differences(rows[args.explain - 1], r)))
    return 0


def _servers(engine: str):
    """The servers file's servers of `engine`, or why there are none to roll out to (in words)."""
    from .eye.servers_file import SERVERS_ENV, load_servers

    path = os.environ.get(SERVERS_ENV)
    if not path:
        return None, (f"no servers to roll out to: {SERVERS_ENV} is not set (name a YAML file listing the servers, "
                      "each with its restart command)")
    try:
        servers = [s for s in load_servers(path).servers if s.engine == engine]
    except ValueError as e:
        return None, str(e)
    return (servers, None) if servers else (None, f"the servers file {path} lists no {engine} server")


def decide(args) -> int:
    """`promote` / `rollback`: a production decision by hand, recorded as production_drafter's materialization (one
    transaction of the event log); with --rollout, the rollout job then puts it on the servers."""
    instance = _instance()
    from .loop import production

    if args.rollout and (why := _servers(args.engine)[1]):  # refused before a decision the servers would not follow
        print(f"{args.cmd} --rollout: {why}; nothing was recorded", file=sys.stderr)
        return 2
    with production.decision_lock(instance):  # the champion read and the decision recorded as one step
        before = production.current(instance, args.engine)
        try:
            if args.cmd == "promote":
                export = production.export_of(instance, args.version)
                meta = production.decision(args.engine, export, "promoted by hand", args.why, before)
            else:
                meta = production.decision(args.engine, production.rollback_target(instance, args.engine, args.to),
                                           "rolled back", args.why, before)
        except ValueError as e:
            print(f"{args.cmd}: {e}", file=sys.stderr)
            return 2
        production.report(instance, args.engine, meta)
    print(f"{args.engine}: {meta['decision']}: {meta['version']} ({meta['export_path']}); replaced {meta['replaced']}")
    if not args.rollout:
        print(f"the servers still serve what they served: `eagle3-assets {args.cmd} ... --rollout`, or launch the "
              f"rollout_drafter job for partition {args.engine}")
        return 0
    from .definitions import defs

    res = defs.resolve_job_def("rollout_drafter").execute_in_process(
        instance=instance, partition_key=args.engine, raise_on_error=False, run_config=QUIET_LOGGERS)
    print(f"rollout {'done' if res.success else 'FAILED'} (run {res.run_id})" + ("" if res.success else
          ": `eagle3-assets production` shows what each server serves now"))
    for event in [] if res.success else res.get_step_failure_events():  # why, where the user typed the command
        data = event.step_failure_data
        why = data.user_failure_data.description if data.user_failure_data else (data.error.message if data.error
                                                                                   else None)
        print(f"rollout: {scrub(str(why or 'see the run in the UI')).strip()}", file=sys.stderr)
    return 0 if res.success else 1


def _one_line(text) -> str:
    """A table cell: a restart's multi-line error (or a reason typed with newlines) kept on its row."""
    return " ".join(str(text).split())


def show_production(args) -> int:
    instance = _instance()
    from .loop import production

    past = production.history(instance, args.engine)
    if not past:
        print(f"nothing in production on {args.engine}: `eagle3-assets promote` puts the newest export there")
        return 0
    for i, h in enumerate(past):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["when"]))
        days = h.get("traffic_days") or []
        print(f"{'now' if i == 0 else '   '}  {when}  {h['version'][:12]}  {h['decision']:22}  replaced "
              f"{str(h.get('replaced'))[:12]:12}" + (f"  traffic {', '.join(days)}" if days else "")
              + (f"  ({_one_line(h['why'])})" if h.get("why") else ""))
    servers, why = _servers(args.engine)
    where = production.on_servers(instance, args.engine, servers or [])
    if why and os.environ.get("EAGLE3_SERVERS"):
        print(f"(the servers file is not read: {why})")
    if not where:
        return 0
    want = past[0]["export_path"].rstrip("/")
    print(f"the servers ({args.engine}), against the record's {past[0]['export_path']}:")
    differ = []
    for name, w in sorted(where.items()):
        same = (w["drafter"] or "").rstrip("/") == want
        differ += [] if same else [name]
        print(f"  {name:16} serves {w['drafter'] or 'unknown'}  ({_one_line(w['how'])})" + ("" if same else "  DIFFERS"))
    if differ:
        print(f"{len(differ)} of {len(where)} servers differ from the record ({', '.join(differ)}): `eagle3-assets "
              f"promote|rollback ... --rollout`, or launch the rollout_drafter job for partition {args.engine}")
    return 0


def serving_loop(args) -> int:
    """`serving-loop`: the README's second story on this instance (eagle3_assets/story/serving_loop.py)."""
    _instance()
    from .story import serving_loop as story

    home = Path(os.environ["DAGSTER_HOME"])
    workspace = Path("workspace.yaml")  # the project's, from its root: the UI's code location, sensor states and all
    return story.main(home, Path(args.workdir) if args.workdir else home / "serving_loop",
                      workspace.resolve() if workspace.exists() else None, kind=args.kind)


def _seconds(text: str) -> float:
    """--deadline's type: a positive, finite number of seconds (argparse names the option in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds: the whole command's time, "
                                         "e.g. --deadline 900") from None
    return value


def parser() -> argparse.ArgumentParser:
    """The command line (also read by the docs' reference page and their test, docs/hooks/reference.py)."""
    ap = argparse.ArgumentParser(prog="eagle3-assets")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("materialize", help="materialize every asset (all shard partitions) into $DAGSTER_HOME")
    m.add_argument("--config", help="run config YAML: {ops: {<asset>: {config: {...}}}}, as in the UI launchpad")
    m.add_argument("--deadline", type=_seconds, metavar="SECONDS",
                   help="end the whole command within this: training's time budget shrinks to what is left after "
                        f"an estimate of the stages that follow it (default with no --config: {EMBEDDED_DEADLINE_S:.0f})")
    lin = sub.add_parser("lineage", help="benchmark results and the checkpoint and training inputs behind each")
    lin.add_argument("--engine", choices=list(NAMES))
    lin.add_argument("--explain", type=int, metavar="N", help="the full lineage of result N (and what changed)")
    lin.add_argument("--served", action="store_true", help="per production server (EAGLE3_SERVERS): the drafter it "
                     "serves, its benchmarks, its live acceptance over time and the drift reports against it")
    for name, what in (("promote", "put an export in production on an engine (default: the newest drafter_export)"),
                       ("rollback", "return an engine to the drafter in production before the current one")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--engine", choices=list(NAMES), default=DEFAULT)
        if name == "promote":
            p.add_argument("--version", help="the export's checkpoint (its data version, 8 characters or more)")
        else:
            p.add_argument("--to", metavar="VERSION", help="a checkpoint that was in production (default: the one "
                           "before the current)")
        p.add_argument("--why", default="", help="recorded with the decision")
        p.add_argument("--rollout", action="store_true", help="then put it on the servers (the rollout_drafter job)")
    prod = sub.add_parser("production", help="what is in production on an engine, and every decision before")
    prod.add_argument("--engine", choices=list(NAMES), default=DEFAULT)
    story = sub.add_parser("serving-loop", help="the second story, after the main command: its drafter served as "
                           "production by vLLM, traffic of a new kind, drift, a retrained challenger, the gate, the "
                           "rollout, the live acceptance before and after")
    story.add_argument("--workdir", help="the servers' pid files and logs, the gateway's log, the servers file "
                       "(default: $DAGSTER_HOME/serving_loop)")
    from .story.gateway import KINDS as TRAFFIC_KINDS

    story.add_argument("--kind", choices=list(TRAFFIC_KINDS), default="fr-es-de", help="the new kind of traffic: "
                       "fr-es-de (French, Spanish, German), or it-pt (Italian, Portuguese) for the loop's second turn "
                       "on the same instance, judged against the drafter the first promoted")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    commands = {"materialize": materialize, "lineage": show_lineage, "promote": decide, "rollback": decide,
                "production": show_production, "serving-loop": serving_loop}
    return commands[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
