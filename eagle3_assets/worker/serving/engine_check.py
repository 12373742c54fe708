"""Stage `engine_check`: ask an engine installed on the host, from its own code, whether it can serve
EAGLE-3 (`serve`) or extract hidden states (`extract`) for the target, without starting it. What
`host_preflight` runs for the engines it is told about; the stages themselves ask again before they start."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .. import engines
from ..errors import StageError
from ..files import resolve

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.engine_check import EngineCheckArgs

PURPOSES = {"serve": "serve EAGLE-3", "extract": "extract hidden states"}


def run(workdir: str, args: EngineCheckArgs, reporter) -> None:
    from ..engines.server import check_support, serve_preflight

    engine = engines.get(args.engine)
    purpose = args.purpose
    if purpose not in PURPOSES:
        raise StageError(f"purpose must be one of {sorted(PURPOSES)}, got {purpose!r}")
    python, target = args.engine_python or sys.executable, resolve(workdir, args.target)
    if purpose == "serve":  # and would the server live past loading a drafter (the stages' dtype, no extra_args)
        info = serve_preflight(engine, python, target)
    else:
        info = check_support(engine, python, target, probe=engine.EXTRACT_PROBE, purpose=PURPOSES[purpose])
    reporter.log(f"{engine.NAME} {info['version']} can {PURPOSES[purpose]} for {info['architecture']} "
                 f"({info.get('model_class', '?')})")
    reporter.result(info)
