"""Stage `engine_check`: ask an engine installed on the host, from its own code, whether it can serve
EAGLE-3 (`serve`) or extract hidden states (`extract`) for the target, without starting it. What
`host_preflight` runs for the engines it is told about; the stages themselves ask again before they start."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from .. import engines
from ..errors import StageError
from ..files import resolve

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.engine_check import EngineCheckArgs

PURPOSES = {"serve": "serve EAGLE-3", "extract": "extract hidden states"}


def run(workdir: str, args: EngineCheckArgs, reporter) -> None:
    from ..compute_dtype import host_device
    from ..engines.server import check_support, serve_refusal
    from .export import compare_config, compare_export, left_out

    engine = engines.get(args.engine)
    purpose = args.purpose
    if purpose not in PURPOSES:
        raise StageError(f"purpose must be one of {sorted(PURPOSES)}, got {purpose!r}")
    python, target = args.engine_python or sys.executable, resolve(workdir, args.target)
    trained = resolve(workdir, args.trained_drafter) if args.trained_drafter else None
    if purpose == "extract":
        info = check_support(engine, python, target, probe=engine.EXTRACT_PROBE, purpose=PURPOSES[purpose])
    else:  # and would the server live past loading a drafter (the launch settings given, else the stages')
        why, info = serve_refusal(engine, python, target, dtype=args.dtype, extra=list(args.extra_args),
                                  unavailable=left_out(engine.NAME, target, trained))
        if why is not None:
            if args.refuse:
                raise StageError(why)
            reporter.log(f"{engine.NAME} refuses: {why}")
            # what no launch setting changes: an MLA target on a CPU host (the gate advises skipping it)
            mla = bool(engines.target_shapes(json.loads((target / "config.json").read_text())).get("mla_latent"))
            info = {**info, "refusal": why, "cpu_mla": mla and host_device() == "cpu"}
        if args.drafter and trained is not None:  # the export as this engine reads it, against its checkpoint
            export = resolve(workdir, args.drafter)
            info["export_readback"] = compare_export(export, trained)
            reporter.log(f"export read back as {engine.NAME} reads it: {info['export_readback']}")
            # ... and its config.json against the checkpoint's, key by key (the target's config alone: no weights)
            from transformers import AutoConfig

            info["export_config_diff"] = compare_config(export, trained, engine.NAME,
                                                        AutoConfig.from_pretrained(str(target)))
            reporter.log(f"export config against the checkpoint's: {info['export_config_diff'] or 'no difference'}")
    if not info.get("refusal"):
        reporter.log(f"{engine.NAME} {info['version']} can {PURPOSES[purpose]} for {info['architecture']} "
                     f"({info.get('model_class', '?')})")
    reporter.result(info)
