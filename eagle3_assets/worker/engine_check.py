"""Stage `engine_check`: ask an engine installed on the host, from its own code, whether it can serve
EAGLE-3 (`serve`) or extract hidden states (`extract`) for the target, without starting it. What
`host_preflight` runs for the engines it is told about; the stages themselves ask again before they start."""

from __future__ import annotations

import sys

from .errors import StageError
from .files import resolve

PURPOSES = {"serve": "serve EAGLE-3", "extract": "extract hidden states"}


def run(workdir: str, args: dict, reporter) -> None:
    from .serve_bench import ENGINES, check_support

    engine = ENGINES.get(args["engine"])
    purpose = args["purpose"]
    if engine is None or purpose not in PURPOSES:
        raise StageError(f"engine must be one of {sorted(ENGINES)} and purpose one of {sorted(PURPOSES)}; got "
                         f"{args.get('engine')!r}, {purpose!r}")
    probe = engine.SUPPORT_PROBE if purpose == "serve" else engine.EXTRACT_PROBE
    info = check_support(engine, args["engine_python"] or sys.executable, resolve(workdir, args["target"]),
                         probe=probe, purpose=PURPOSES[purpose])
    reporter.log(f"{engine.NAME} {info['version']} can {PURPOSES[purpose]} for {info['architecture']} "
                 f"({info.get('model_class', '?')})")
    reporter.result(info)
