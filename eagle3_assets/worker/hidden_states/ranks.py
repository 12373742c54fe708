"""The hf backend on several processes of one host (`num_processes`): one per GPU, or one per share of a CPU
host's cores, started by torchrun (worker/torchrun.py). Every rank reads the same shard, takes its share of
the samples (split by tokens, so the ranks finish together), runs the target on its own device and writes its
own part files (`part-r<rank>-NNNN`) into the shard's one temporary directory, then a small JSON of what it
wrote. The launcher, which holds the Pipes connection and the output's lock, merges the ranks' lists and
publishes the one manifest: a shard is complete only when every rank finished."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .. import torchrun
from ..compute_dtype import cores
from ..errors import StageError
from ..shards.writer import Sample

TMP_ENV = "EAGLE3_EXTRACT_TMP"  # the shard's temporary directory, where the ranks write


def is_rank() -> bool:
    return torchrun.launched() and TMP_ENV in os.environ


def split(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Longest sample first to the rank with the fewest tokens so far (the lowest rank on a tie): shares
    within one sample's length of each other, the same split on every rank."""
    shares: list[list[Sample]] = [[] for _ in range(n)]
    load = [0] * n
    for s in sorted(samples, key=lambda s: (-len(s.input_ids), s.row)):
        r = min(range(n), key=lambda i: (load[i], i))
        shares[r].append(s)
        load[r] += len(s.input_ids)
    return [sorted(sh, key=lambda s: s.row) for sh in shares]


def check(n: int, device: str) -> None:
    """Refuse, before a process starts, a split the host cannot run: more processes than GPUs (or cores), or
    one named GPU for several processes."""
    import torch

    if device.startswith("cuda:"):
        raise StageError(f"device {device} names one GPU, but num_processes is {n}: set device to auto or cuda "
                         f"(the processes take cuda:0..{n - 1}), or num_processes to 1")
    if device in ("auto", "cuda") and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if n > gpus:
            raise StageError(f"num_processes {n} is more than this host's {gpus} GPUs (CUDA_VISIBLE_DEVICES "
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): set num_processes to at most {gpus}")
    elif device == "cuda":
        raise StageError("device is cuda, but torch sees no GPU on this host: set device to auto or cpu")
    elif n > cores():
        raise StageError(f"num_processes {n} is more than this CPU host's {cores()} cores: set it to at most "
                         f"{cores()} (on a CPU the processes share the cores)")


def launch(workdir: str, args, reporter, n: int, tmp: Path) -> tuple[list[dict], list[dict], list[str], float]:
    """The shard's samples over n ranks, into `tmp`: (part files, index rows, the ranks' devices, the slowest
    rank's compute seconds)."""
    env = {TMP_ENV: str(tmp)}
    if not (args.device in ("auto", "cuda") and _has_gpu()):  # CPU ranks share the cores instead of oversubscribing
        env["OMP_NUM_THREADS"] = str(max(1, cores() // n))
    torchrun.run("extract", workdir, args.model_dump_json(), n, reporter, f"extraction of shard {args.shard}", env)
    done = []
    for r in range(n):
        try:
            done.append(json.loads((tmp / f".rank-{r}.json").read_text()))
        except (OSError, ValueError):
            raise StageError(f"extraction rank {r} of {n} ended without listing what it wrote: the shard is not "
                             "published; see the run's log for that rank's error") from None
    files = sorted((f for d in done for f in d["files"]), key=lambda f: f["name"])
    index = [row for d in done for row in d["index"]]
    return files, index, [d["device"] for d in done], max(d["wall_s"] for d in done)


def rank_main(extract_samples, model_loader, samples: list[Sample], aux_layers: list[int], args, reporter,
              what: str) -> None:
    """One rank: its share of `samples` through `extract_samples` (the stage's own forward and writer, passed
    in) into the launcher's temporary directory, then its list of what it wrote (written last, by rename: the
    launcher never reads half a list)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tmp = Path(os.environ[TMP_ENV])
    try:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if args.device in ("auto", "cuda") and _has_gpu() \
            else "cpu"
        share = split(samples, world)[rank]
        model = model_loader(device)
        tokens = sum(len(s.input_ids) for s in share)
        t0 = time.monotonic()
        with reporter.progress(f"{what} (rank {rank} of {world})", tokens, unit="tokens") as prog:
            writer = extract_samples(model, share, tmp, aux_layers, batch_tokens=int(args.batch_tokens),
                                     part_bytes=int(args.part_bytes), io_threads=int(args.io_threads), progress=prog,
                                     storage=args.storage, prefix=f"part-r{rank:02d}-")
        listing = {"rank": rank, "device": device, "files": writer.files, "index": writer.index,
                   "tokens": tokens, "wall_s": time.monotonic() - t0}
        part = tmp / f".rank-{rank}.json.part"
        part.write_text(json.dumps(listing))
        part.rename(tmp / f".rank-{rank}.json")
    except Exception as e:
        reporter.log(f"extraction rank {rank} of {world} failed: {type(e).__name__}: {e}", "error", every_rank=True)
        raise


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
