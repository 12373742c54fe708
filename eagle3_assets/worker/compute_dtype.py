"""Which dtype a stage computes in, when it is not told: bfloat16 on a GPU and on a CPU with bf16
instructions (AVX512-BF16 or AMX), float32 on any other CPU, where bf16 matmuls are emulated and run ~80x
slower than float32 (0.4 against 32 GFLOP/s measured on an AVX2-only AMD EPYC). An explicit dtype wins.
Every stage that computes records the choice and the CPU's instruction set in its metadata."""

from __future__ import annotations

import os
import platform
from functools import lru_cache

AUTO = "auto"
DTYPES = ("bfloat16", "float16", "float32")
FORCE_ENV = "EAGLE3_CPU_BF16"  # "0" / "1": take the probe's answer as given (tests, or a CPU it misjudges)
_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@lru_cache(maxsize=1)
def cpu() -> dict:
    """The host CPU: its name, the instruction-set extensions that decide bf16 speed, and the verdict."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    forced = os.environ.get(FORCE_ENV)
    if forced in ("0", "1"):
        bf16, how = forced == "1", f"{FORCE_ENV}={forced}"
    else:
        import torch

        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and bool(flags & {"avx512_bf16", "amx_bf16"})
        how = "oneDNN and /proc/cpuinfo"
    return {"cpu": name, "cpu_isa": [f for f in _ISA if f in flags], "cpu_bf16": bf16, "cpu_bf16_probe": how}


def cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve(requested: str | None, device: str) -> str:
    """The dtype to compute in on `device` ('cuda...' or 'cpu') for a stage asked for `requested`."""
    if requested and requested != AUTO:
        if requested not in DTYPES:
            from .errors import StageError

            raise StageError(f"dtype must be auto or one of {list(DTYPES)}, got {requested!r}")
        return requested
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu()["cpu_bf16"] else "float32"


def choice(requested: str | None, device: str) -> dict:
    """Metadata for the choice: the dtype, why, and the CPU it was made for."""
    dtype = resolve(requested, device)
    why = "set" if requested and requested != AUTO else ("GPU" if device.startswith("cuda") else
                                                         "CPU with bf16 instructions" if dtype == "bfloat16" else
                                                         "CPU without bf16 instructions")
    info = {"dtype": dtype, "dtype_choice": why}
    if not device.startswith("cuda"):
        info.update(cpu())
    return info


def line(info: dict) -> str:
    """The choice in one log line."""
    where = f" on {info['cpu']} ({', '.join(info['cpu_isa']) or 'no AVX'})" if "cpu" in info else ""
    return f"computing in {info['dtype']} ({info['dtype_choice']}){where}"


def host_device(device: str = "auto") -> str:
    """The device this host's stages compute on: its GPU when there is one (an engine server too)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
