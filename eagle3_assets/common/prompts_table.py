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
