"""Load for an OpenAI-compatible server: streaming completions at a fixed concurrency, greedy, each request
timed (time to first token, time per output token, output tokens); and whole completions for generating
training data (`generate`). Standard library only, so it runs in any host environment next to the server."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse


@dataclass
class Request:
    id: str
    prompt_token_ids: list[int]


@dataclass
class Response:
    id: str
    text: str
    output_tokens: int
    ttft_s: float
    latency_s: float
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, the decode speed a user feels."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def complete(base_url: str, model: str, req: Request, max_tokens: int, timeout_s: float = 600.0) -> Response:
    """One streaming /v1/completions request, greedy; token ids in, so every engine sees the same prompt
    tokens (no second chat template in the server)."""
    url = urlparse(base_url)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Response(req.id, "", 0, 0.0, time.perf_counter() - t0,
                            error=f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}")
        for raw in resp:  # server-sent events: `data: {...}` lines, `data: [DONE]` at the end
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(choice["text"])
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Response(req.id, "".join(parts), 0, ttft or 0.0, time.perf_counter() - t0,
                        error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    latency = time.perf_counter() - t0
    n = int(usage["completion_tokens"]) if usage else len(parts)
    return Response(req.id, "".join(parts), n, ttft if ttft is not None else latency, latency)


def drive(base_url: str, model: str, requests: list[Request], max_tokens: int, concurrency: int,
          on_done=None) -> tuple[list[Response], float]:
    """All requests, `concurrency` in flight at a time; returns responses in request order and wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(complete, base_url, model, r, max_tokens) for r in requests]
        out = []
        for f in futures:
            out.append(f.result())
            if on_done:
                on_done(out[-1])
    return out, time.perf_counter() - t0


@dataclass
class Completion:
    """One whole (non-streamed) completion, as generation for training data needs it."""
    id: str
    text: str
    token_ids: list[int] | None  # the engine's own ids of the reply, where it returns them
    finish_reason: str | None  # "stop": the model ended it; "length": max_tokens did
    matched_stop: int | str | None = None  # SGLang: the stop token it ended on
    error: str | None = None


def _complete_whole(base_url: str, model: str, req: Request, max_tokens: int, fields: dict,
                    timeout_s: float = 600.0) -> Completion:
    url = urlparse(base_url)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": max_tokens, **fields, "stream": False}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return Completion(req.id, "", None, None, error=f"HTTP {resp.status}: {data[:500].decode(errors='replace')}")
        choice = json.loads(data)["choices"][0]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        return Completion(req.id, "", None, None, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    ids = choice.get("token_ids")
    return Completion(req.id, choice.get("text") or "", list(ids) if ids is not None else None,
                      choice.get("finish_reason"), choice.get("matched_stop"))


SKIPPED = "skipped: it would not have finished within the time budget"


def generate(base_url: str, model: str, requests: list[Request], max_tokens: int, concurrency: int,
             fields: list[dict], on_done=None, deadline: float | None = None) -> list[Completion]:
    """All requests, `concurrency` in flight, each with its own sampling fields; completions in request order.
    `deadline` (time.monotonic()): a request whose typical latency so far would take it past the deadline is not
    sent (error SKIPPED); the first `concurrency` always are, so that there is a latency to go by."""
    latencies: list[float] = []

    def one(r: Request, f: dict) -> Completion:
        start = time.monotonic()
        if deadline is not None and latencies and start + sorted(latencies)[len(latencies) // 2] > deadline:
            return Completion(r.id, "", None, None, error=SKIPPED)
        c = _complete_whole(base_url, model, r, max_tokens, f)
        latencies.append(time.monotonic() - start)
        return c

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, r, f) for r, f in zip(requests, fields)]
        out = []
        for f in futures:
            out.append(f.result())
            if on_done:
                on_done(out[-1])
    return out


def summarize(responses: list[Response], wall_s: float) -> dict:
    ok = [r for r in responses if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    tpots = sorted(t for r in ok if (t := r.tpot_s) is not None)
    ttfts = sorted(r.ttft_s for r in ok)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    return {
        "requests": len(responses), "failed_requests": len(responses) - len(ok), "output_tokens": tokens,
        "wall_s": round(wall_s, 3), "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_ms_mean": round(1000 * sum(ttfts) / len(ttfts), 2) if ttfts else None,
        "ttft_ms_p90": round(1000 * pct(ttfts, 0.9), 2) if ttfts else None,
        "tpot_ms_mean": round(1000 * sum(tpots) / len(tpots), 2) if tpots else None,
        "tpot_ms_p90": round(1000 * pct(tpots, 0.9), 2) if tpots else None,
    }
