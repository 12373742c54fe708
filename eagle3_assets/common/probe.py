"""What a host is asked before a stage runs there: its Python, the worker's dependencies, the eagle3-assets
code it would run, GPUs, free disk. Standard library only, and run as `python -c <this source> ARGS_JSON`
so that it answers even on a host where eagle3-assets is missing or broken.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys

# What `python -m eagle3_assets.worker` imports on the host (the control plane's own deps are not needed).
WORKER_DEPS = ["dagster-pipes", "pydantic", "torch", "transformers", "safetensors", "accelerate", "pyarrow", "numpy", "tqdm",
               "datasketch"]


# The packages a worker imports: its own, the stage contracts it validates its arguments with, and what both
# halves read (the rest of eagle3_assets is the control plane, never imported on a host).
WORKER_PACKAGES = ("common", "stages", "worker")


def worker_files(package_dir: str) -> list[str]:
    """The files the worker runs from, relative to the package: what code upload ships and the
    fingerprint covers."""
    out = ["__init__.py"]
    for pkg in WORKER_PACKAGES:
        for root, dirs, files in os.walk(os.path.join(package_dir, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [os.path.relpath(os.path.join(root, f), package_dir) for f in sorted(files) if f.endswith(".py")]
    return out


def read_files(package_dir: str) -> dict:
    """The worker files' bytes by relative path ('/'-separated), read once: what is hashed is what is shipped."""
    out = {}
    for rel in worker_files(package_dir):
        with open(os.path.join(package_dir, rel), "rb") as f:
            out[rel.replace(os.sep, "/")] = f.read()
    return out


def fingerprint_of(files: dict) -> str:
    h = hashlib.sha256()
    for rel, data in files.items():
        h.update(rel.encode() + b"\0")
        h.update(data + b"\0")
    return h.hexdigest()[:16]


def digests_of(files: dict) -> dict:
    """sha256 of each worker file: what names the files of an uploaded copy that were changed on the host."""
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}


def _package(code_dir):
    if code_dir:
        sys.path.insert(0, code_dir)
    spec = importlib.util.find_spec("eagle3_assets")
    if spec is None or not spec.submodule_search_locations:
        return {"installed": False}
    pkg = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(pkg, "__init__.py")):  # a damaged copy: a namespace package
        return {"installed": False, "dir": pkg}
    with open(os.path.join(pkg, "__init__.py")) as f:
        m = re.search(r'__version__\s*=\s*"([^"]+)"', f.read())
    files = read_files(pkg)
    return {"installed": True, "dir": pkg, "version": m.group(1) if m else None, "fingerprint": fingerprint_of(files),
            "files": digests_of(files)}


def _gpus() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi is not on the host's PATH (no NVIDIA driver?)", "gpus": []}
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return {"error": "nvidia-smi did not answer within 30 s", "gpus": []}
    if out.returncode != 0:
        return {"error": f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:500]}", "gpus": []}
    gpus = []
    for line in out.stdout.strip().splitlines():
        idx, name, total, used = [x.strip() for x in line.split(",")]
        gpus.append({"index": int(idx), "name": name, "memory_total_mib": int(total), "memory_used_mib": int(used)})
    return {"gpus": gpus}


def probe(args: dict) -> dict:
    workdir = os.path.abspath(os.path.expanduser(args["workdir"]))
    out = {"python": platform.python_version(), "executable": sys.executable, "hostname": platform.node(),
           "platform": platform.platform(), "workdir": workdir, "deps": {}, "missing": []}
    for dep in WORKER_DEPS:
        try:
            out["deps"][dep] = importlib.metadata.version(dep)
        except importlib.metadata.PackageNotFoundError:
            out["missing"].append(dep)
    out["package"] = _package(args.get("code_dir"))
    existing = workdir
    while not os.path.exists(existing):  # the work directory may not exist yet: its disk is its parent's
        existing = os.path.dirname(existing)
    usage = shutil.disk_usage(existing)
    out["disk"] = {"path": existing, "free_bytes": usage.free, "total_bytes": usage.total}
    if args.get("gpus"):
        out.update(_gpus())
    return out


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))), flush=True)
