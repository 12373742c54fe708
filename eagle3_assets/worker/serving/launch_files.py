"""The files a schedule is served with, written beside the export (`<export>/../<engine>-launch/`, the layout in
eagle3_assets/common/launch.py): vLLM's speculative config (pass it as it is: `vllm serve ... --speculative-config
"$(cat speculative_config.vllm.json)"`), SGLang's adaptive config, and routing.json for a fleet's router. Written by
the sweep (load_curve) and, where its verification makes the schedule fall back to off somewhere, the benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from ...common import spec_schedule
from ..files import atomic_file


def write(out_dir: Path, drafter: str, schedule: spec_schedule.Schedule) -> dict[str, str]:
    """Every launch file of `schedule` into `out_dir`, each replaced whole; {metadata key: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    if vllm_cfg := spec_schedule.vllm_config("eagle3", drafter, schedule):
        files["vllm_speculative_config"] = _write(out_dir / "speculative_config.vllm.json", spec_schedule.dumps(vllm_cfg))
    else:  # a schedule that never drafts: no config left from an earlier one to start a server with
        (out_dir / "speculative_config.vllm.json").unlink(missing_ok=True)
    files["sglang_adaptive_config"] = _write(out_dir / "adaptive.sglang.json",
                                             json.dumps(spec_schedule.sglang_adaptive_config(schedule), indent=1))
    # a fleet's router: requests in flight below this go to the drafter's servers, the rest to servers without one
    files["routing"] = _write(out_dir / "routing.json", json.dumps(
        {"speculate_up_to": spec_schedule.speculate_up_to(schedule), "schedule": spec_schedule.describe(schedule)}))
    return files


def _write(path: Path, text: str) -> str:
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return str(path)
