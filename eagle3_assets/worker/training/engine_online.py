"""Online hidden states from the serving engine (`hidden_states: online`, `online_from: vllm`): for a target no
training GPU holds, the product's vLLM extraction streams each batch's states into the trainer
(engines/vllm/streaming.py); nothing is written.

The same contracts as online from the target (online.py): the samples are the conversations' in the extraction's
order, the batch plan the offline one (seeded by (seed, epoch)), a resumed run continues at its step; each batch's
pieces (its samples cut to what their rows keep) go to the engine as one pass, in the batch's order, and come back
checked against what was asked. The prefetching thread asks for the next batch while the drafter steps on this one,
so the engine computes one batch ahead of the trainer; when the trainer is slower, the engine waits on the socket.
The labels: the target's head (the trainer loads it in any mode) on the final states. The first batch's first
samples are checked against the transformers forward where the target fits this host (the integration gate's
hidden-state parity, hidden_states/parity.py): an engine whose capture is broken fails the run before a step."""

from __future__ import annotations

from pathlib import Path

import torch

from ...common.shard_format import LAYER_CONVENTION
from ..engines.vllm.streaming import EngineStream
from ..errors import StageError
from ..files import sha256_file
from ..shards.writer import Sample
from .online import Conversations, OnlineStates

WINDOW = 16  # samples asked of the engine ahead of the one handed on
DEPTH = 4  # frames received and not yet taken
PARITY_SAMPLES = 2  # of the first batch, checked against the transformers forward (the integration gate's check)


class EngineStates(OnlineStates):
    """The training data of an online run fed by the engine: quacks like OnlineStates (refs, tokens, identity,
    `read`, `host_batch` and `finish`), with no target in this process."""

    kind = "online-engine"

    def __init__(self, convs: Conversations, target: Path, aux_layers: list[int], num_layers: int, settings,
                 reporter, log: Path, device: str):
        self.convs, self.refs, self.target, self.reporter = convs, convs.refs, target, reporter
        self.aux_layer_ids, self.dtype_name = list(aux_layers), str(settings.dtype)
        self.parity: dict | None = None  # the first batch's check, once made
        self.engine = EngineStream(target, self.aux_layer_ids, num_layers, settings, reporter,
                                   convs.max_length + 1, log, WINDOW, DEPTH).__enter__()
        self.device = device  # where `device_batch` finishes a batch
        info = self.engine.run.info
        self.source = f"vllm {info['version']}"
        self.identity = [{"conversations": sha256_file(convs.path), "samples": len(self.refs),
                          "max_length": convs.max_length, "aux_layer_ids": self.aux_layer_ids,
                          "layer_convention": LAYER_CONVENTION, "dtype": self.dtype_name,
                          "engine": "vllm", "engine_version": info["version"]}]
        self.head = None

    def read_many(self, refs: list) -> list[dict[str, torch.Tensor]]:
        """Samples with their states in float32 on the CPU, as `ShardSet.read` gives them: one pass."""
        samples = [self._sample(k, r.offset) for k, r in enumerate(refs)]
        return [{**self.convs.read(ref), "aux": aux.float(), "final": final.float()}
                for ref, (_, aux, final) in zip(refs, self.engine.states(samples))]

    def read(self, ref, stored: bool = False) -> dict[str, torch.Tensor]:
        return self.read_many([ref])[0]

    def _sample(self, row: int, i: int) -> Sample:
        return Sample(row, f"sample {i}", self.convs.ids[i].tolist(), self.convs.masks[i].tolist())

    def host_batch(self, rows: list[list[int]], row_tokens: int, loss_on: str, rows_per_batch: int,
                   pad: bool = False, pin: bool = False) -> dict:
        from .evaluate import host_batch

        batch = host_batch(self.convs, rows, row_tokens, None, loss_on, rows_per_batch, pad=pad, pin=pin)
        pieces = self.pieces(rows, batch["input_ids"].shape[1], row_tokens, rows_per_batch, masks=True)
        auxs, finals = [], []
        for _, aux, final in self.engine.states([p for _, p in pieces]):
            auxs.append(aux)
            finals.append(final)
        if self.parity is None:
            self.parity = self._parity([p for _, p in pieces], auxs, finals)
        dest = torch.cat([torch.arange(d, d + len(s.input_ids)) for d, s in pieces])
        aux, final = torch.cat(auxs), torch.cat(finals)
        if pin:
            aux, final, dest = aux.pin_memory(), final.pin_memory(), dest.pin_memory()
        batch.update(_aux=aux, _final=final, _dest=dest)
        return batch

    def _parity(self, samples: list, auxs: list, finals: list) -> dict:
        """The engine's states of the first samples against the transformers forward, or why they were not."""
        from ..compute_dtype import choice
        from ..hidden_states.parity import parity
        from ..target.model import load_config, load_model, text_config
        from ..target.moe_routing import routing
        from ..target.size import check_fits

        dtype = choice(self.dtype_name, self.device)["dtype"]
        try:
            check_fits(self.target, dtype, self.device)
        except StageError as e:
            self.reporter.log(f"hidden-state parity not checked on the first batch: {e}", "warning")
            return {"checked": False, "why": str(e)}
        model = load_model(self.target, dtype, self.device)
        n = min(PARITY_SAMPLES, len(samples))
        found = parity(model, self.aux_layer_ids, [{"input_ids": s.input_ids, "aux": a.float(), "final": f.float()}
                                                   for s, a, f in zip(samples[:n], auxs, finals)],
                       routing(text_config(load_config(self.target))) is not None)
        del model
        line = "; ".join(f"{name} norm ratio {v['norm_ratio']:.4f} cosine {v['cosine']:.4f}"
                         for name, v in found["layers"].items())
        if not found["passed"]:
            raise StageError(f"the engine's hidden states differ from the transformers forward's on the first batch "
                             f"({', '.join(found['failed_layers'])} outside {found['tolerance']}): {line}. The "
                             "engine's capture is broken for this target: nothing was trained on them")
        self.reporter.log(f"hidden-state parity on the first batch ({found['tokens']} tokens): {line}")
        return {"checked": True, **found}

    def finish(self, batch: dict) -> dict:
        dev = batch["input_ids"].device
        aux, final, dest = (batch.pop(k).to(dev, non_blocking=True) for k in ("_aux", "_final", "_dest"))
        return self.packed(batch, aux, final, dest)

    def close(self) -> None:
        self.engine.close()
