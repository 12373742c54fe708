"""Where the target writes data, token ids in and token ids out: `hf`, batched `generate` in the worker; each
engine of worker/engines/ (`vllm`, `sglang`), the target served on the host and asked through its API, for
large sets. Stages `generate` (replies) and `synthesize` (prompts) both write through these.

A backend is a context manager giving `complete(prompts, seeds, sampler, progress, deadline=None) ->
[Completion | None]`: each prompt's ids exactly as fed, and what the target produced, its end-of-turn token
included only where it emitted one. With a `deadline` (time.monotonic()), work that would end past it by the
time it has taken so far is not started, and its prompts come back None."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import engines
from ..errors import StageError
from ..target.model import load_model


@dataclass(frozen=True)
class Sampler:
    """How one kind of text is drawn: temperature 0 is greedy."""
    name: str
    temperature: float
    top_p: float
    seed: int


@dataclass
class Completion:
    prompt_ids: list[int]  # exactly what the target was fed
    ids: list[int]  # what it produced, its end-of-turn token included when it emitted one
    text: str  # decoded as produced (special tokens dropped, nothing stripped)
    capped: bool  # stopped by max_new_tokens, not by the model


@dataclass(frozen=True)
class Settings:
    """What a backend needs of the stage's arguments (generate's and synthesize's share these names)."""
    backend: str
    dtype: str
    device: str
    max_new_tokens: int
    max_model_len: int
    batch_size: int
    seed: int
    engine_python: str | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    ready_timeout_s: float = 1200.0
    language_model_only: bool | None = None

    @classmethod
    def of(cls, args, max_model_len: int) -> Settings:
        return cls(args.backend, args.dtype, getattr(args, "device", "auto"), args.max_new_tokens, max_model_len,
                   args.batch_size, args.seed, args.engine_python, tuple(args.extra_args or ()),
                   tuple((str(k), str(v)) for k, v in (args.env or {}).items()), args.ready_timeout_s,
                   getattr(args, "language_model_only", None))


def eos_ids(tok, generation_config=None) -> set[int]:
    eos = getattr(generation_config, "eos_token_id", None)
    eos = eos if eos is not None else tok.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


@contextmanager
def hf_backend(s: Settings, target: Path, tok, log_dir: Path, reporter) -> Iterator:
    """Batched `generate` in this process, batches of similar lengths (less padding)."""
    import torch

    model = load_model(target, s.dtype, s.device)
    tok.padding_side = "left"  # decoder-only batched generation pads on the left
    stops = eos_ids(tok, model.generation_config)

    def complete(prompts: list[list[int]], seeds: list[int], sampler: Sampler, prog,
                 deadline: float | None = None) -> list[Completion | None]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Completion | None] = [None] * len(prompts)
        sample = sampler.temperature > 0
        took: list[float] = []  # each batch's time: the next one is expected to take their median
        for start in range(0, len(order), s.batch_size):
            if deadline is not None and took and time.monotonic() + sorted(took)[len(took) // 2] > deadline:
                break
            t0 = time.monotonic()
            idx = order[start: start + s.batch_size]
            width = max(len(prompts[i]) for i in idx)
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device=model.device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx],
                                device=model.device)
            if sample:
                torch.manual_seed(seeds[idx[0]])  # a batch shares one generator: seeded by its first prompt's
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=s.max_new_tokens,
                                     do_sample=sample, temperature=sampler.temperature if sample else None,
                                     top_p=sampler.top_p if sample else None, pad_token_id=tok.pad_token_id)
            tokens = 0
            for i, new in zip(idx, gen[:, width:].tolist()):
                n = next((k for k, t in enumerate(new) if t in stops), None)
                own = new[: n + 1] if n is not None else new
                out[i] = Completion(prompts[i], own, tok.decode(own, skip_special_tokens=True), n is None)
                tokens += len(own)
            prog.update(len(idx), tokens=tokens)
            took.append(time.monotonic() - t0)
        return out

    yield complete


def server_backend(engine_name: str):
    """The target served by the engine on the host (the same launch code as serve_bench, without a drafter),
    `batch_size` requests in flight through its OpenAI-compatible API. Every request carries its own seed;
    the server's prefix cache shares a prompt's prefill between its completions."""

    @contextmanager
    def backend(s: Settings, target: Path, tok, log_dir: Path, reporter) -> Iterator:
        from ..engines import load
        from ..engines.server import EngineServer, check_support, free_port

        engine = engines.get(engine_name)
        python = s.engine_python or sys.executable
        text_only = engine.text_only(target, check_support(engine, python, target), s.language_model_only)
        argv = engine.server_command(python, str(target), free_port(), drafter=None, k=0, dtype=s.dtype,
                                     max_model_len=s.max_model_len, seed=s.seed, extra=list(s.extra_args),
                                     language_model_only=text_only)
        env = {**engine.SERVER_ENV, **dict(s.env)}
        from transformers import GenerationConfig

        try:  # what the engine stops on: the generation config's end tokens, as hf's generate does
            stops = eos_ids(tok, GenerationConfig.from_pretrained(target))
        except OSError:  # no generation_config.json: the tokenizer's
            stops = eos_ids(tok)
        with EngineServer(f"{engine_name} (generation)", argv, int(argv[argv.index("--port") + 1]),
                          log_dir / f"server-{engine_name}.log", env=env, health=engine.HEALTH) as server:
            reporter.log(f"starting {engine_name} for generation: {' '.join(argv[1:])}")
            ready = server.wait_ready(float(s.ready_timeout_s), reporter)
            reporter.log(f"{engine_name} ready after {ready:.0f} s")

            def complete(prompts: list[list[int]], seeds: list[int], sampler: Sampler, prog,
                         deadline: float | None = None) -> list[Completion | None]:
                reqs = [load.Request(str(i), ids) for i, ids in enumerate(prompts)]
                fields = [{"temperature": sampler.temperature, "top_p": sampler.top_p, "seed": seed,
                           **engine.GENERATION_FIELDS} for seed in seeds]
                done = load.generate(server.base_url, "target", reqs, s.max_new_tokens, s.batch_size, fields,
                                     on_done=lambda c: prog.update(1), deadline=deadline)
                bad = [c for c in done if c.error and c.error != load.SKIPPED]
                if bad:
                    raise StageError(f"{len(bad)} generation requests to {engine_name} failed, first: {bad[0].error}"
                                     + (f"\n{why}" if (why := server.died()) else ""))
                out = [None if c.error else _from_server(c, p, tok, stops) for c, p in zip(done, prompts)]
                prog.update(0, tokens=sum(len(c.ids) for c in out if c))
                return out

            # how the engine was launched, and how long it took to start (the main command's deadline reads it)
            complete.launch = {"language_model_only": text_only, "server_ready_s": round(ready, 1)}
            yield complete

    return backend


def _from_server(c, prompt: list[int], tok, stops: set[int]) -> Completion:
    """An engine's completion as ids: its own token ids where it returns them (vLLM's `return_token_ids`: the
    stop token included), else the text tokenized again (SGLang's completions carry none) and the stop token
    it names (`matched_stop`), or the first end token when it names none."""
    stopped = c.finish_reason == "stop"
    if c.token_ids is not None:
        return Completion(prompt, list(c.token_ids), c.text, not stopped)
    ids = tok(c.text, add_special_tokens=False)["input_ids"]
    if stopped:
        ids.append(c.matched_stop if isinstance(c.matched_stop, int) else min(stops))
    return Completion(prompt, ids, c.text, not stopped)


BACKENDS = {"hf": hf_backend, **{name: server_backend(name) for name in engines.NAMES}}


def backend(s: Settings, target: Path, tok, log_dir: Path, reporter):
    if s.backend not in BACKENDS:
        raise StageError(f"backend must be one of {sorted(BACKENDS)}, got {s.backend!r}")
    return BACKENDS[s.backend](s, target, tok, log_dir, reporter)


def degenerate(ids: list[int], n: int = 4, min_len: int = 32, min_distinct: float = 0.25) -> bool:
    """A text that loops: at least `min_len` tokens whose n-grams are mostly repeats (fewer than
    `min_distinct` of them distinct)."""
    if len(ids) < min_len:
        return False
    grams = [tuple(ids[i: i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) < min_distinct
