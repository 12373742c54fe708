"""Hidden-state capture with SGLang, in the engine's own environment: `python -m
eagle3_assets.worker.engines.sglang.capture SPEC.json`, started by the extract stage (extraction.py beside it).

SGLang has no server API that returns chosen layers (`return_hidden_states` gives the post-norm final state
only), so this drives its model runner in-process, tensor parallel, the way SGLang's own offline script
`python -m sglang.bench_one_batch` does (held to SGLang 0.5.14; cannot run on the machines this project is
tested on, see tests/serving/test_engines.py for the contract checked against that release's source):
- one process per tensor-parallel rank and data-parallel group, each a `ModelRunner` (radix cache off,
  chunked prefill off, CUDA graphs off: every sample is one whole extend);
- the aux layers through SGLang's capture (`capture_aux_hidden_states` + the text model's
  `layers_to_capture`, set directly in SGLang's capture-before numbering, so no model class's own reading of
  the ids applies) with `CaptureHiddenMode.FULL`, which returns them for every token, concatenated in layer
  order; the final state before the norm from a hook on the text model's final norm (SGLang's captured
  last state is post-norm);
- tensor-parallel rank 0 of each group writes its samples with our ShardWriter and reports with the same
  parts file as vLLM's connector. Progress: tokens done, in `progress-d<dp>`.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path


def _text_model(model):
    """The causal LM whose `.model` holds the decoder (Kimi-K2.5's KimiK25ForConditionalGeneration hands over
    to its `language_model`)."""
    lm = getattr(model, "language_model", None) or model
    if not hasattr(lm, "model") or not hasattr(lm.model, "layers_to_capture"):
        raise RuntimeError(f"{type(model).__name__}: no text model with SGLang's aux-layer capture (layers_to_capture)")
    return lm


def _rank(spec: dict, dp: int, tp_rank: int, port_args) -> None:
    from array import array

    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from ....common.shard_format import part_tokens
    from ...shards.writer import Sample, ShardWriter
    from ..dump import mask_from_spans, parts_file, write_parts

    server_args = _server_args(spec)
    tp = server_args.tp_size
    gpu_id = dp * tp + tp_rank
    runner = ModelRunner(model_config=ModelConfig.from_server_args(server_args),
                         mem_fraction_static=server_args.mem_fraction_static, gpu_id=gpu_id, tp_rank=tp_rank,
                         tp_size=tp, moe_ep_rank=tp_rank // (tp // server_args.ep_size), moe_ep_size=server_args.ep_size,
                         pp_rank=0, pp_size=1, nccl_port=port_args.nccl_port, server_args=server_args)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    lm = _text_model(runner.model)
    lm.capture_aux_hidden_states = True
    lm.model.layers_to_capture = list(spec["capture_ids"])
    final: list = []

    def keep_pre_norm(_module, inputs, output):
        # norm(h, residual) returns (normed, h + residual): the second is the pre-norm last state
        final.append((output[1] if isinstance(output, tuple) else inputs[0]).clone())

    hook = lm.model.norm.register_forward_hook(keep_pre_norm)
    out_dir = Path(spec["out_dir"])
    samples = [Sample(s["row"], s["id"], s["input_ids"], mask_from_spans(len(s["input_ids"]), s["loss_spans"]))
               for s in spec["samples"]][dp::spec["data_parallel_size"]]
    writer = None
    if tp_rank == 0:
        hidden = lm.config.hidden_size
        dtype = getattr(torch, spec["dtype"])
        storage = spec.get("storage", "native")
        tokens = part_tokens(int(spec["part_bytes"]), hidden, spec["dtype"], storage)
        writer = ShardWriter(out_dir, hidden, dtype, tokens, int(spec["io_threads"]), pin=torch.cuda.is_available(),
                             prefix=f"part-d{dp}-", storage=storage)
    cols, fcol, problems, done = spec["aux_columns"], spec["final_column"], [], 0

    class _NoPrefixCache:  # what ScheduleBatch asks of a tree cache when nothing is shared (bench_one_batch's)
        page_size, device = server_args.page_size, runner.device
        token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator

        def supports_swa(self):
            return False

        def supports_mamba(self):
            return False

        def is_chunk_cache(self):
            return False

        def is_tree_cache(self):
            return True

        def evict(self, params):
            pass

    with torch.no_grad():
        for batch in _batches(samples, int(spec["batch_tokens"])):
            reqs = []
            for s in batch:
                req = Req(rid=str(s.row), origin_input_text="", origin_input_ids=array("q", s.input_ids),
                          sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
                req.full_untruncated_fill_ids = req.origin_input_ids
                req.fill_len = len(req.full_untruncated_fill_ids)
                req.logprob_start_len = -1
                req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
                reqs.append(req)
            sb = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                        tree_cache=_NoPrefixCache(), model_config=runner.model_config,
                                        enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
            sb.prepare_for_extend()
            if sb.input_ids is None and getattr(sb, "prefill_input_ids_cpu", None) is not None:
                sb.input_ids = sb.prefill_input_ids_cpu.to(sb.device, non_blocking=True)
                sb.prefill_input_ids_cpu = None
            sb.capture_hidden_mode = CaptureHiddenMode.FULL
            fb = ForwardBatch.init_new(sb, runner)
            fb.capture_hidden_mode = CaptureHiddenMode.FULL
            final.clear()
            out = runner.forward(fb).logits_output
            lengths = [len(s.input_ids) for s in batch]
            n, H = sum(lengths), lm.config.hidden_size
            if writer is not None:
                captured = out.hidden_states  # [tokens, captured layers x H], layer order
                if captured is None or captured.shape[0] != n or not final or final[-1].shape[0] != n:
                    problems.append(f"rows {[s.row for s in batch]}: SGLang returned "
                                    f"{None if captured is None else tuple(captured.shape)} aux and "
                                    f"{tuple(final[-1].shape) if final else None} final rows for {n} tokens")
                else:
                    layers = torch.cat([captured.view(n, -1, H), final[-1].view(n, 1, H)], dim=1)
                    o = 0
                    for s, ln in zip(batch, lengths):
                        rows = layers[o: o + ln]
                        writer.add([s], [ln], rows[:, cols].flatten(1).contiguous(), rows[:, fcol].contiguous())
                        o += ln
                done += n
                (out_dir / f"progress-d{dp}").write_text(str(done))
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
    hook.remove()
    if tp_rank == 0:
        write_parts(out_dir / parts_file(dp), spec["nonce"], dp, writer, problems)


def _batches(samples, batch_tokens: int):
    cur, size = [], 0
    for s in sorted(samples, key=lambda s: -len(s.input_ids)):
        if cur and size + len(s.input_ids) > batch_tokens:
            yield cur
            cur, size = [], 0
        cur.append(s)
        size += len(s.input_ids)
    if cur:
        yield cur


def _server_args(spec: dict):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=spec["target"], tp_size=int(spec["tensor_parallel_size"]), dtype=spec["dtype"],
                      trust_remote_code=bool(spec.get("trust_remote_code")), disable_radix_cache=True,
                      chunked_prefill_size=-1, disable_cuda_graph=True, random_seed=int(spec.get("seed", 0)),
                      **(spec.get("server_args") or {}))


def main(spec_path: str) -> int:
    from sglang.srt.server_args import PortArgs

    spec = json.loads(Path(spec_path).read_text())
    server_args = _server_args(spec)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for dp in range(int(spec["data_parallel_size"])):
        port_args = PortArgs.init_new(server_args)  # each group its own NCCL port
        for tp_rank in range(server_args.tp_size):
            p = ctx.Process(target=_rank, args=(spec, dp, tp_rank, port_args), daemon=True)
            p.start()
            procs.append(p)
    for p in procs:
        p.join()
    return max((p.exitcode or 0) != 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
