"""Our KV connector for vLLM's `extract_hidden_states` method: it writes the hidden states of finished
requests straight into a shard's part files (our format, hashed as written), with no per-request files to
repack. Loaded by vLLM itself (`--kv-transfer-config` with `kv_connector_module_path` naming this module),
so it runs inside the engine's processes and imports vLLM; the extract stage (extraction.py beside it) is
its client.

How a shard is made: the client sends every sample as a `max_tokens=1` completion whose
`kv_transfer_params` carry `{"eagle3": {"dir", "row", "id", "loss_spans"}}`; the connector copies the
request's rows of the hidden-state cache into the part buffers of `<root>/<dir>` (the scheduler delays
freeing the blocks until the copy is done). Then the client sends one `{"eagle3": {"dir", "flush": nonce}}`
request per data-parallel engine; that engine finishes its last part and writes
`engine-parts-d<dp>.json` (parts, index rows, problems). Only tensor-parallel rank 0 writes, and
`get_finished_count() == 1` tells vLLM to expect one notification per request, or its blocks would never be
freed. The layers arrive in the order of the capture ids; `columns` (extra config) says which are aux and
which is the final state, so the translation between conventions lives in one place (engines/vllm/__init__.py).

In stream mode (extra config `stream`: a Unix socket's path) nothing is written: each finished request's states
go to the socket as one frame (shards/stream.py: header with row, id, token ids and loss spans; tensors aux and
final), and a flush request sends an end frame with its nonce. The send blocks while the consumer is behind, and
with it the engine's next step: the engine waits for the trainer. A consumer gone is logged once and the frames
after it dropped; the client sees the samples missing (streaming.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from ....common.shard_format import part_tokens
from ...shards.stream import Sender
from ...shards.writer import Sample, ShardWriter
from ..dump import mask_from_spans, parts_file, write_parts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
KEY = "eagle3"


@dataclass
class PendingSave:
    req_id: str
    params: dict
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class Eagle3ConnectorMetadata(KVConnectorMetadata):
    pending_saves: list[PendingSave] = field(default_factory=list)


class Eagle3ShardConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError("Eagle3ShardConnector needs the 'extract_hidden_states' speculative method")
        extra = self._kv_transfer_config.get_from_extra_config
        self.root = Path(extra("root", "")).resolve()
        self.part_bytes = int(extra("part_bytes", 1 << 30))
        self.io_threads = int(extra("io_threads", 4))
        self.storage = str(extra("storage", "native"))
        self.aux_columns = [int(c) for c in extra("aux_columns", [0, 1, 2])]
        self.final_column = int(extra("final_column", 3))
        self.stream = str(extra("stream", "") or "")
        self._sender: Sender | None = None
        self._stream_broken = False
        self.dp_rank = int(vllm_config.parallel_config.data_parallel_rank or 0)
        self.group_id = self._hidden_state_group(kv_cache_config)
        self.block_size = (kv_cache_config.kv_cache_groups[self.group_id].kv_cache_spec.block_size
                           if kv_cache_config is not None else vllm_config.cache_config.block_size)
        # scheduler side
        self._params: dict[str, dict] = {}
        self._pending: list[PendingSave] = []
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._rank0 = True
        self._writers: dict[str, ShardWriter] = {}
        self._problems: dict[str, list[str]] = {}
        self._events: dict[str, Any] = {}  # req_id -> CUDA event of its copy, None when already done
        self._finished: set[str] = set()

    @staticmethod
    def _hidden_state_group(kv_cache_config) -> int:
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if len(ids) == 1:
            return ids[0]
        if not ids and len(groups) == 1:
            return 0
        raise ValueError(f"the hidden-state cache is not in a KV cache group of its own ({len(groups)} groups): this "
                         "vLLM cannot isolate it for this target's attention (MLA targets hit this in some releases)")

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 reports; the default (every worker) would leak every request's blocks

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {len(layers)}")
        self._kv_cache = kv_caches[layers[0]]  # [blocks, captured layers, block_size, hidden]
        if self._kv_cache.shape[2] != self.block_size:
            raise ValueError(f"hidden-state cache block size {self._kv_cache.shape[2]} != {self.block_size}")

    def start_load_kv(self, *args, **kwargs) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # the states are in the cache after the forward; copied once the request finishes

    def wait_for_save(self) -> None:
        pass

    def _writer(self, name: str) -> ShardWriter:
        w = self._writers.get(name)
        if w is None:
            out = self.root / name
            out.mkdir(parents=True, exist_ok=True)
            cache = self._kv_cache
            hidden = cache.shape[3]
            tokens = part_tokens(self.part_bytes, hidden, str(cache.dtype).removeprefix("torch."), self.storage)
            w = self._writers[name] = ShardWriter(out, hidden, cache.dtype, tokens, self.io_threads,
                                                  pin=cache.is_cuda, prefix=f"part-d{self.dp_rank}-",
                                                  storage=self.storage)
            self._problems[name] = []
        return w

    def _save(self, p: PendingSave) -> None:
        e = p.params
        name = str(e["dir"])
        if not self._rank0:
            return
        if "flush" in e:
            if self.stream:
                self._send({"id": f"flush {e['flush']}", "flush": str(e["flush"]), "dp_rank": self.dp_rank}, {})
            else:
                self._flush(name, str(e["flush"]))
            self._events[p.req_id] = None
            return
        n = len(p.token_ids)
        blocks = torch.tensor(p.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        if slots.numel() < n:  # fewer cached rows than prompt tokens: a short dump
            self._problems.setdefault(name, []).append(
                f"row {e['row']} ({e['id']}): {slots.numel()} hidden-state rows for {n} tokens")
            n = slots.numel()
        slots = slots[:n].to(self._kv_cache.device, non_blocking=True)
        states = self._kv_cache[slots // self.block_size, :, slots % self.block_size]  # [n, captured, H]
        aux = states[:, self.aux_columns].flatten(1)
        final = states[:, self.final_column]
        ids = p.token_ids[:n]
        if self.stream:  # copied to the host and sent now: the blocks are free once this returns
            self._send({"id": str(e["id"]), "row": int(e["row"]), "input_ids": ids,
                        "loss_spans": e.get("loss_spans") or [], "tokens": len(p.token_ids)},
                       {"aux": aux.cpu(), "final": final.cpu()})
            self._events[p.req_id] = None
            return
        w = self._writer(name)
        w.add([Sample(int(e["row"]), str(e["id"]), ids, mask_from_spans(n, e.get("loss_spans") or []))], [n], aux, final)
        self._events[p.req_id] = w.cur.event

    def _send(self, header: dict, tensors: dict[str, torch.Tensor]) -> None:
        if self._stream_broken:
            return
        try:
            if self._sender is None:
                self._sender = Sender(self.stream)
            self._sender.send(header, tensors)  # blocks while the consumer is behind: the engine waits
        except OSError as e:
            self._stream_broken = True
            logger.error("eagle3 stream to %s broke at sample %s (%s): the frames after it are dropped",
                         self.stream, header.get("id"), e)

    def _flush(self, name: str, nonce: str) -> None:
        write_parts(self.root / name / parts_file(self.dp_rank), nonce, self.dp_rank, self._writers.pop(name, None),
                    self._problems.pop(name, []))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, Eagle3ConnectorMetadata):
                for p in meta.pending_saves:
                    self._save(p)
        self._finished.update(finished_req_ids)
        done = set()
        for req_id in list(self._finished):
            if req_id not in self._events:
                if not self._rank0:
                    self._finished.discard(req_id)
                continue
            event = self._events[req_id]
            if event is not None and not event.query():
                continue  # device -> host copy still in flight: the blocks stay allocated
            del self._events[req_id]
            self._finished.discard(req_id)
            done.add(req_id)
        return done or None, None

    def shutdown(self):
        if self._sender is not None:
            self._sender.close()
        for w in self._writers.values():  # unfinished shards: the client never publishes them
            w.pool.shutdown(wait=True, cancel_futures=True)

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = Eagle3ConnectorMetadata(pending_saves=self._pending)
        self._pending = []
        for new in scheduler_output.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            params = (extra.get("kv_transfer_params") or {}).get(KEY)
            if params is not None:
                self._params[new.req_id] = params
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = self._params.pop(request.request_id, None)
        if params is None:
            return False, None  # not ours (or aborted before it was scheduled): nothing to save
        name = str(params.get("dir", ""))
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            logger.error("eagle3 request %s names the shard directory %r: only a plain name under %s is allowed",
                         request.request_id, name, self.root)
            return False, None
        self._pending.append(PendingSave(request.request_id, params, list(request.prompt_token_ids or []),
                                         list(block_ids)))
        return True, {"eagle3": {"dir": name}}

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group_id])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # each token's captured layers together, as the slot indexing above reads them
