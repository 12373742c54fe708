"""The redactor's throughput (sources/redact.py), which the `traffic` asset runs once per message of each request
kept: a fixed, seeded mix of requests as a gateway sees them (English, Portuguese and Italian prose, Python code
with numbers, a stack trace with IPs and paths, a JSON payload with ids and dates), a fifth of them carrying one
planted personal value, the rest carrying none (the common case: the patterns must be cheap when nothing is found).
Prints requests/s, MB/s and µs per request in CPU time of this process (best of --repeat: on a shared machine wall
time measures the neighbours too), with the CPU; nothing is written.

    python bench/redact_bench.py [--requests 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from eagle3_assets.sources.redact import Redactor

PROSE = [
    "Explain consensus in distributed systems in plain words, with an example of a network partition and what a "
    "leader election does when two nodes of five are cut off for 30 seconds.",
    "Preciso de ajuda para escrever um e-mail formal ao meu gerente pedindo férias de 15 dias em julho de 2026, "
    "explicando que o projeto 4821 estará entregue até o dia 30 e que a equipe de 7 pessoas cobre minha ausência.",
    "Scrivi un riassunto di 200 parole sul Rinascimento fiorentino, citando tre artisti e le date principali "
    "(1434, 1478, 1492) e spiega perché la famiglia Medici fu così importante per la città.",
    "Our order 100234587 shipped on 2026-11-28 in 3 boxes (12.5 kg); tracking 1Z999AA10123456784 shows no update "
    "since Tuesday. What should I tell the customer, and when do I escalate to the carrier?",
]
CODE = [
    "def moving_average(xs, k=3):\n    out = []\n    for i in range(len(xs) - k + 1):\n        out.append(sum(xs[i:i "
    "+ k]) / k)\n    return out\n\nprint(moving_average([1, 2, 3, 4, 5, 6], 2))  # why 5.5 at the end?\n",
    "Traceback (most recent call last):\n  File \"/srv/app/worker.py\", line 118, in run\n    conn = connect('10.0.3.17"
    "', 5432, timeout=2.5)\nConnectionRefusedError: [Errno 111] Connection refused\nversion 1.24.3, build 20261130"
    ".4471, x[1::2] slice; how do I retry with backoff?",
    "{\"invoice\": 20261127001, \"lines\": [{\"sku\": \"A-3391-22\", \"qty\": 4, \"price\": 19.90}], \"created\": "
    "\"2026-11-27T10:22:31Z\", \"customer\": 88123}\nParse this JSON in Go and sum price * qty per invoice.",
]
PII = [" Meu CPF é 529.982.247-25.", " Il mio IBAN è IT60 X054 2811 1010 0000 0123 456.",
       " My SSN is 536-22-1847.", " Mail me at jane.doe@example-mail.com.", " Call +1 415 555 2671.",
       " Clone https://ghp_Xq7vB2nLk9PzR4tWm8YcJd3FxK1LpQ0@github.com/acme/app.git", " P.IVA IT00743110157.",
       " Aadhaar 2345 6789 0124, PAN AAPFU0939F.", " Codice fiscale RSSMRA85T10A562S."]


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def requests(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.sample(PROSE, 2)) + "\n" + rng.choice(CODE)
        if rng.random() < 0.2:
            text += rng.choice(PII)
        out.append(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    texts, redactor = requests(args.requests), Redactor()
    redactor.redact(texts[0])  # first-use costs (phone metadata, stdnum registries) are not per request
    best, found = float("inf"), None
    for _ in range(args.repeat):
        t0 = time.process_time()
        counts = [redactor.redact(t)[1] for t in texts]
        best = min(best, time.process_time() - t0)
        found = sum(counts, start=type(counts[0])())
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"CPU: {_cpu()}; {args.requests} requests, {mb:.2f} MB, best of {args.repeat}")
    print(f"{args.requests / best:,.0f} requests/s, {mb / best:.2f} MB/s, {best / args.requests * 1e6:.0f} µs per "
          f"request; found {dict(sorted(found.items()))}")


if __name__ == "__main__":
    main()
