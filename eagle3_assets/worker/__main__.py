"""Entry point on the GPU host: `python -m eagle3_assets.worker <stage> --workdir DIR --args JSON`.

Under Dagster the Pipes bootstrap variables are in the environment and everything is reported through
them; run by hand, output goes to the terminal and the result JSON to stdout.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from contextlib import nullcontext

from ..stages import ArgsError, describe, validate
from ..stages.base import Args
from . import output_lock
from .errors import StageError
from .parent import die_with_parent
from .report import Reporter
from .stages import STAGES


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m eagle3_assets.worker",
                                 epilog="`python -m eagle3_assets.worker STAGE --help` lists the stage's arguments")
    ap.add_argument("stage", choices=sorted(STAGES))
    if len(argv) >= 2 and argv[0] in STAGES and ("--help" in argv[1:] or "-h" in argv[1:]):
        print(describe(argv[0]))
        sys.exit(0)
    ap.add_argument("--workdir", required=True, help="host work directory; stage paths are relative to it")
    ap.add_argument("--args", default="{}", help="stage arguments as JSON")
    ap.add_argument("--args-file", help="read the stage arguments from this JSON file instead")
    return ap.parse_args(argv)


def _read_args(ns: argparse.Namespace) -> Args:
    """The stage's arguments (its contract's Args model), checked before anything is imported or written."""
    where = ns.args_file or "--args"
    try:
        if ns.args_file:
            with open(ns.args_file) as f:
                raw = json.load(f)
        else:
            raw = json.loads(ns.args)
    except (OSError, ValueError) as e:
        raise ArgsError(f"cannot read the {ns.stage} arguments from {where}: {e}") from None
    return validate(ns.stage, raw)


def _run(ns: argparse.Namespace, reporter: Reporter, own_process: bool = False) -> int:
    try:
        args = _read_args(ns)
    except ArgsError as e:
        reporter.error(str(e))
        return 2
    reporter.stage = ns.stage  # what it reports is checked against the stage's contract too
    if own_process and getattr(args, "nice", 0):  # a stage that yields the host's CPU (a replay beside production);
        os.nice(int(args.nice))  # a process-wide setting: never the caller's, where a test runs the stage in its own
    os.makedirs(ns.workdir, exist_ok=True)
    try:
        # a data-parallel rank runs under its launcher, which holds the output's lock
        with nullcontext() if os.environ.get("EAGLE3_REPORT_JSONL") == "1" else \
                output_lock.hold(ns.workdir, ns.stage, args, reporter.log):
            STAGES[ns.stage](ns.workdir, args, reporter)
    except StageError as e:
        reporter.error(str(e))
        return 2
    except Exception as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # not a bug: the host's disk filled; say where
            free = shutil.disk_usage(ns.workdir).free
            reporter.error(f"{ns.stage} stopped: the disk of the work directory {ns.workdir} is full "
                           f"({free / 1e6:,.1f} MB free; writing {e.filename or 'a file'} failed): free space there, "
                           "or point the host's workdir at a bigger disk, and run again")
            return 2
        # an unexpected bug: keep the traceback, but also say it in one line
        reporter.error(f"{ns.stage} crashed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return 1
    return 0


class _Stopped(BaseException):
    def __init__(self, sig: int):
        self.sig = sig


def _stop_on(sig: int, _frame) -> None:
    # A cancel (Dagster's SIGTERM to the job's process group) or a lost terminal unwinds the stage like an
    # error, so that its `with` blocks run: engine servers stop, temporary shards are removed.
    raise _Stopped(sig)


def _stop_again_if_swallowed(unraisable) -> None:
    # A signal handler runs wherever the main thread is, and inside a finalizer (`__del__`, a weakref callback)
    # Python prints the exception and carries on: the stop would be lost and the stage would finish as if
    # never cancelled. Deliver the signal again a moment later, from a thread: sent from here, the handler
    # would run inside this hook, where an exception is ignored too.
    if isinstance(unraisable.exc_value, _Stopped):
        again = threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.sig))
        again.daemon = True
        again.start()
    else:
        sys.__unraisablehook__(unraisable)


def install_stop_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on)
    sys.unraisablehook = _stop_again_if_swallowed


def main(argv: list[str] | None = None) -> int:
    ns = _parse(sys.argv[1:] if argv is None else argv)
    install_stop_handlers()
    die_with_parent()
    return run(ns, own_process=True)


def run(ns: argparse.Namespace, own_process: bool = False) -> int:
    """The stage the command line names, reported through Pipes when Dagster started this process, else to the
    terminal with the result JSON on stdout; the exit status. (Tests run it in their own process too.)"""
    if "DAGSTER_PIPES_CONTEXT" in os.environ:
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            rc = _run(ns, Reporter(pipes), own_process)
    else:
        reporter = Reporter()
        rc = _run(ns, reporter, own_process)
        if rc == 0 and os.environ.get("EAGLE3_REPORT_JSONL") != "1":
            print(json.dumps(reporter.result_payload))
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except _Stopped as stop:  # then die of the signal itself, so supervisors see a stop, not an exit status
        signal.signal(stop.sig, signal.SIG_DFL)
        os.kill(os.getpid(), stop.sig)
