"""Stage `traffic_sample`: a day of served prompts (the `traffic` asset's partition), redacted before they reached
this host, cut to `max_prompts` free of near duplicates (data/dedup.py, as synthetic prompts are): the candidates
come in the seeded order of the control plane's sample, and each is kept unless it nearly repeats a held-out prompt
or one kept before it. Each kept prompt carries the cheap keys a report groups traffic by (data/prompt_groups.py): the
length of its user text (a bucket), the first words of its last user turn, and its kind (structured data, another
language, code, maths, prose)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common.prompts_table import TRAFFIC_SCHEMA
from ..files import atomic_file, require_file, resolve
from .dedup import NearDuplicates
from .prompt_groups import GROUP_BY, keys, served_groups, user_text

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.traffic_sample import TrafficSampleArgs

# the prompts table's four columns first: conversations reads a partition as prompts
SCHEMA = pa.schema([*TRAFFIC_SCHEMA,  # timestamp: epoch seconds, null when placed by its file's date
    ("user_chars", pa.int32()),
    ("length_bucket", pa.string()),
    ("first_words", pa.string()),
    ("kind", pa.string()),
])


def run(workdir: str, args: TrafficSampleArgs, reporter) -> None:
    cand_path = require_file(resolve(workdir, args.candidates), "the day's redacted traffic candidates",
                             "materialize the traffic partition again (the control plane uploads them)")
    held = [require_file(resolve(workdir, p), "held-out prompts", "materialize prompts first") for p in args.held_out]
    candidates = pq.read_table(cand_path).to_pylist()
    dedup, held_count = NearDuplicates(args.dedup_threshold), 0
    for p in held:
        for i, r in enumerate(pq.read_table(p, columns=["messages"]).to_pylist()):
            dedup.add(f"held:{p.name}:{i}", user_text(r["messages"]))
            held_count += 1
    kept, dropped, examined = [], Counter(), 0
    for c in candidates:
        if len(kept) >= args.max_prompts:
            break
        examined += 1
        text = user_text(c["messages"])
        near = dedup.near(text)
        if near:
            dropped["of_held_out" if near[0].startswith("held:") else "within"] += 1
            continue
        dedup.add(f"kept:{len(kept)}", text)
        kept.append({**{f.name: c.get(f.name) for f in TRAFFIC_SCHEMA}, **keys(c["messages"])})
    out = resolve(workdir, args.out)
    with atomic_file(out, fsync=True) as tmp:
        pq.write_table(pa.Table.from_pylist(kept, schema=SCHEMA), tmp)
    Path(cand_path).unlink()  # redacted, but nothing reads it again
    version = hashlib.sha256(json.dumps([[r["id"], r["messages"]] for r in kept], ensure_ascii=False).encode())
    reporter.log(f"traffic sample: {len(kept)} of {len(candidates)} candidates kept ({examined} examined); near "
                 f"duplicates dropped: {dropped['within']} of each other, {dropped['of_held_out']} of the "
                 f"{held_count} held-out prompts")
    served = served_groups(kept, [*GROUP_BY, *args.group_fields], args.min_group)
    if served["requests"]:
        reporter.log(f"served figures on {served['requests']} of the {len(kept)} requests kept: acceptance length "
                     f"{served['acceptance_length']} over {served['steps']} speculative steps")
    reporter.materialize(metadata={
        "path": str(out), "prompts": len(kept), "candidates": len(candidates), "candidates_examined": examined,
        "near_duplicates_within": dropped["within"], "near_duplicates_of_held_out": dropped["of_held_out"],
        "held_out_prompts": held_count, "dedup_threshold": args.dedup_threshold,
        "by_length_bucket": dict(Counter(r["length_bucket"] for r in kept)),
        "by_kind": dict(Counter(r["kind"] for r in kept)),
        "preview": "\n".join(f"- {r['first_words']!r}: {user_text(r['messages'])[:100]!r}" for r in kept[:5]),
        "dagster/row_count": len(kept), "requests_served": served["requests"],
        **({"served_acceptance_length": served["acceptance_length"], "served_steps": served["steps"],
            "served_groups": served["groups"],
            # per kind too, as numbers: the UI plots each kind's served acceptance day by day
            **{f"served_acceptance_length_{g['value'].replace('-', '_')}": g["acceptance_length"]
               for g in served["groups"] if g["by"] == "kind"}} if served["requests"] else {}),
    }, data_version=version.hexdigest()[:32])
