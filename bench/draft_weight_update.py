"""What vLLM 0.32's runtime draft weight update does on this host: the path rollout would take instead of a restart.

Starts the vLLM CPU build serving an exported drafter with a weight transfer backend (`--weight-transfer-config`,
dev mode for the /rl endpoints), then walks the protocol a trainer drives over HTTP: /init_weight_transfer_engine,
/start_draft_weight_update, /update_weights with the new drafter's tensors, /finish_weight_update; and checks the
server still answers and still speculates. Each step's HTTP status and message is recorded as it happened.

    python bench/draft_weight_update.py --workdir /tmp/mix --drafter EXPORT_DIR --new NEW_EXPORT_DIR [--allow-pickle]

Writes bench/results/draft_weight_update.json (its "runs": without and with --allow-pickle, 2026-12-04)."""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import platform
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def post(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (127.0.0.1)
            return {"status": r.status, "body": r.read().decode()[:600], "s": round(time.monotonic() - t0, 2)}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode()[:600], "s": round(time.monotonic() - t0, 2)}
    except OSError as e:
        return {"status": None, "body": f"{type(e).__name__}: {e}", "s": round(time.monotonic() - t0, 2)}


def update_info(new: Path, backend: str) -> tuple[dict | None, str]:
    """The /update_weights payload for the new drafter's tensors as a trainer builds it, or why none can be built."""
    import torch
    from safetensors.torch import load_file

    tensors = {k: v for f in sorted(new.glob("*.safetensors")) for k, v in load_file(f).items()}
    base = {"names": list(tensors), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in tensors.values()],
            "shapes": [list(v.shape) for v in tensors.values()]}
    if backend != "ipc":
        return None, f"the {backend} backend's tensors travel over NCCL from a trainer process, not over HTTP"
    if not torch.cuda.is_available():
        # a CPU tensor's handle is a shared-memory file descriptor (rebuild_storage_fd), not the
        # rebuild_cuda_tensor arguments the worker expects: sent anyway, to record what the server says
        from torch.multiprocessing.reductions import reduce_tensor
        handles = [{"cpu": reduce_tensor(v.contiguous())[1]} for v in tensors.values()]
        try:
            pickled = base64.b64encode(pickle.dumps(handles)).decode()
        except Exception as e:  # noqa: BLE001 (recorded as the finding)
            return None, f"no CUDA here: a CPU tensor's IPC handle cannot even be pickled ({type(e).__name__}: {e})"
        return {**base, "ipc_handles_pickled": pickled}, "no CUDA here: CPU shared-memory handles sent instead"
    return None, "CUDA is here: use vLLM's IPCTrainerWeightTransferEngine from the trainer process"


def main() -> int:
    from eagle3_assets.worker.engines import vllm
    from eagle3_assets.worker.engines.server import EngineServer, free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--target", default=None, help="default: <workdir>/target/SmolLM2-135M-Instruct")
    ap.add_argument("--drafter", required=True, help="the vLLM export served first")
    ap.add_argument("--new", required=True, help="the vLLM export whose weights are pushed")
    ap.add_argument("--backend", default="ipc")
    ap.add_argument("--allow-pickle", action="store_true", help="VLLM_ALLOW_INSECURE_SERIALIZATION=1: the pickled "
                    "IPC handles the HTTP transport carries are refused without it")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_weight_update.json"))
    a = ap.parse_args()
    w = Path(a.workdir)
    target = a.target or str(w / "target" / "SmolLM2-135M-Instruct")
    port = free_port()
    argv = vllm.server_command(sys.executable, target, port, drafter=a.drafter, k=3, dtype="float32",
                               max_model_len=1024, seed=0,
                               extra=["--enforce-eager", "--weight-transfer-config", json.dumps({"backend": a.backend})])
    steps: dict[str, dict] = {}
    url = f"http://127.0.0.1:{port}"
    out = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
           "backend": a.backend, "allow_pickle": a.allow_pickle, "argv": argv[2:], "steps": steps}
    srv = EngineServer("vllm (weight transfer)", argv, port, w / "draft-weight-update.log",
                       env={**vllm.SERVER_ENV, "VLLM_SERVER_DEV_MODE": "1",
                            **({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if a.allow_pickle else {})})
    try:
        with srv:
            t0 = time.monotonic()
            srv.wait_ready(600)
            steps["start"] = {"status": 200, "body": "healthy", "s": round(time.monotonic() - t0, 1)}
            ask = {"model": "target", "prompt": "Explain what a hash map is.", "max_tokens": 32, "temperature": 0}
            steps["completion_before"] = post(f"{url}/v1/completions", ask)
            steps["init_weight_transfer_engine"] = post(f"{url}/init_weight_transfer_engine",
                                                        {"init_info": {"packed": False}})
            steps["start_draft_weight_update"] = post(f"{url}/start_draft_weight_update")
            info, why = update_info(Path(a.new), a.backend)
            steps["update_weights"] = post(f"{url}/update_weights", {"update_info": info}) if info else \
                {"status": None, "body": "not sent: " + why}
            steps["update_weights"]["note"] = why
            steps["finish_weight_update"] = post(f"{url}/finish_weight_update")
            steps["completion_after"] = post(f"{url}/v1/completions", ask)
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:  # noqa: S310
                from eagle3_assets.common.spec_counters import vllm_counters
                out["spec_counters_after"] = vllm_counters(r.read().decode())
    except Exception as e:  # noqa: BLE001 (a server that will not start is the finding)
        out["error"] = f"{type(e).__name__}: {e}"
        log = w / "draft-weight-update.log"
        out["server_log_tail"] = log.read_text()[-2000:] if log.exists() else ""
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
