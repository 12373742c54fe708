"""The prompts table (`prompts/*.parquet`): the columns every prompt set has, whichever half writes it. The
`prompts` asset writes it on the Dagster machine, the synthesize stage on the host; traffic partitions add
columns after these four, so `conversations` reads any of them as prompts."""

import pyarrow as pa

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
PROMPTS_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("messages", MESSAGES),
    ("num_user_turns", pa.int32()),
])

# A traffic day's columns after the prompts' (both halves write them: the candidates on the Dagster machine, the day's
# sample on the host). `served_*`: what production served this request, from the response a gateway logged with it
# (vLLM's --per-request-spec-decode-metrics: steps, draft tokens accepted and proposed, k), null where the log holds
# no such response; `gateway_fields`: the record's fields a team named (a tenant, a route) as JSON text, redacted.
SERVED_FIELDS = [
    ("served_steps", pa.int32()),
    ("served_accepted", pa.int32()),
    ("served_drafted", pa.int32()),
    ("served_k", pa.int32()),
]
TRAFFIC_SCHEMA = pa.schema([*PROMPTS_SCHEMA, ("timestamp", pa.float64()), *SERVED_FIELDS, ("gateway_fields", pa.string())])


def served_acceptance_length(steps: int, accepted: int) -> float | None:
    """vLLM's mean acceptance length of a request (or of many, summed): the bonus token plus the drafts accepted per
    verify step."""
    return round(1 + accepted / steps, 4) if steps else None
