"""Reading a host's probe (`common/probe.py`): what is wrong with it for a stage, in words a user can act on."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from ..common import probe
from ..common.sizes import size_text

# Stages that need an accelerator on a host that says it has one (`require_gpus`).
GPU_STAGES = frozenset({"generate", "synthesize", "extract", "train", "speculate", "serve_bench"})
PROBE_SOURCE = Path(probe.__file__).read_text()
PACKAGE_DIR = str(Path(probe.__file__).resolve().parent.parent)


@lru_cache(maxsize=1)
def local_code() -> dict[str, bytes]:
    """The worker code as this control plane first read it: uploads ship these bytes, so the copy on the host
    matches its fingerprint even if the files here are edited while the control plane runs."""
    return probe.read_files(PACKAGE_DIR)


@lru_cache(maxsize=1)
def local_fingerprint() -> str:
    return probe.fingerprint_of(local_code())


@lru_cache(maxsize=1)
def local_files() -> dict[str, str]:
    return probe.digests_of(local_code())


def problems(info: dict[str, Any], *, where: str, gpus: bool, min_free_bytes: int,
             code: str, need_bytes: int | None = None) -> list[str]:
    """Everything that stops a stage from running on this host; empty when it can run."""
    out = []
    if tuple(int(x) for x in info["python"].split(".")[:2]) < (3, 10):
        out.append(f"{where}: Python {info['python']} at {info['executable']} is too old; the worker needs 3.10+")
    if info["missing"]:
        out.append(f"{where}: the Python at {info['executable']} lacks the worker's dependencies "
                   f"{', '.join(info['missing'])}: install them into that environment "
                   f"(pip install 'eagle3-assets[worker]' brings them all) or point `python` at one that has them")
    pkg = info["package"]
    if code == "installed" and not pkg.get("installed"):
        out.append(f"{where}: eagle3-assets is not installed for {info['executable']}: pip install "
                   f"'eagle3-assets[worker]' there, or set code: upload to run the control plane's own worker code")
    elif code == "installed" and pkg["fingerprint"] != local_fingerprint():
        from .. import __version__
        out.append(f"{where}: the host runs eagle3-assets {pkg['version']} (worker code {pkg['fingerprint']}) from "
                   f"{pkg['dir']}, the control plane {__version__} (worker code {local_fingerprint()}): install "
                   f"the same version there, or set code: upload")
    if gpus and not info.get("gpus"):
        out.append(f"{where}: no GPU found ({info.get('error', 'nvidia-smi listed none')}); this stage needs one. "
                   f"If the host is meant to run on CPU, set require_gpus: false")
    free = info["disk"]["free_bytes"]
    need = max(min_free_bytes, need_bytes or 0)
    if free < need:
        why = f"the estimated {size_text(need_bytes)} of hidden states" if need_bytes and need_bytes >= min_free_bytes \
            else f"min_free_gb ({min_free_bytes / 1e9:g} GB)"
        out.append(f"{where}: only {size_text(free)} free on the disk of {info['disk']['path']}, less than "
                   f"{why}: free space there or move the host's workdir to a bigger disk")
    return out


def summary(info: dict[str, Any]) -> str:
    deps = info["deps"]
    gpus = info.get("gpus")
    gpu_txt = "" if gpus is None else f", {len(gpus)} GPU(s)" + (f" ({gpus[0]['name']})" if gpus else "")
    return (f"{info['hostname']}: Python {info['python']}, torch {deps.get('torch', '-')}, transformers "
            f"{deps.get('transformers', '-')}{gpu_txt}, {info['disk']['free_bytes'] / 1e9:,.1f} GB free under "
            f"{info['disk']['path']}")
