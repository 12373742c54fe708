"""traffic: what the served drafter is asked, one partition per day, from the serving gateway's request logs
(traffic_sources.py says which formats and how a request is placed in its day).

Where it runs, and why there: the logs are read, sampled and redacted here, on the Dagster machine, so that no raw
text reaches the host (its files, its stage's logs) nor Dagster's event log or metadata: only the redacted
candidates are uploaded, and the host's stage (`traffic_sample`) drops near duplicates of each other and of every
held-out prompt set (MinHash, data/dedup.py: a worker package) and writes the day's Parquet file, which
`conversations` can read as prompts (its first four columns are the prompts schema)."""

import os
import tempfile
import time
from pathlib import Path
from typing import Literal

import dagster as dg
import phonenumbers
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from ..assets.paths import HELD_OUT
from ..assets.upstream import upstream_metadata
from ..code_versions import code_version
from ..common.prompts_table import TRAFFIC_SCHEMA
from ..hosts import GpuHost, Held
from ..sources.gateway_logs import TIMESTAMP_FIELDS, TrafficStats, read_day, redacted_rows
from ..sources.prompt_files import PromptError
from ..sources.redact import KINDS, Redactor
from ..stages.traffic_sample import TrafficSampleSettings

LOGS_ENV = "EAGLE3_TRAFFIC_LOGS"  # the sources when the config names none: comma-separated paths, URLs, globs
START_ENV, TZ_ENV = "EAGLE3_TRAFFIC_START", "EAGLE3_TRAFFIC_TIMEZONE"
TRAFFIC_DIR = "traffic"  # <day>.parquet per partition, under the host work directory

# Read as the code location loads: the first day a backfill can ask for, and where days begin (UTC by default).
# end_offset 1: today is a partition too, holding the day so far (a drift seen this morning is located in this
# morning's traffic; materializing it again later takes the rest of the day).
traffic_partitions = dg.DailyPartitionsDefinition(start_date=os.environ.get(START_ENV) or "2026-01-01",
                                                  timezone=os.environ.get(TZ_ENV) or "UTC", end_offset=1)


class TrafficConfig(dg.Config, TrafficSampleSettings):
    """The sample's settings (the traffic_sample stage's, eagle3_assets/stages/traffic_sample.py), and how the
    logs are read."""

    sources: list[str] = Field(default=[], description=f"the gateway's request logs: paths or fsspec URLs, globs "
                               f"allowed (.jsonl / .ndjson, optionally .gz); empty: ${LOGS_ENV}, comma-separated")
    seed: int = Field(default=0, description="the sample's seed: the same logs and seed give the same sample")
    oversample: float = Field(default=3.0, ge=1, description="candidates redacted and checked for near duplicates "
                              "per prompt kept (the rest of the day is ranked, never redacted)")
    timestamp_fields: list[str] = Field(default=TIMESTAMP_FIELDS, min_length=1, description="a record's fields, "
                                        "first present wins, holding epoch seconds or an ISO 8601 time")
    phone_region: str = Field(default="US", description="the region a phone number without its +country code is "
                              "read as from (ISO 3166 code)")
    group_fields: list[str] = Field(default=[], description="the gateway record's fields to cut acceptance by (a "
                                    "tenant, a route; a dotted path reads into an object: metadata.tenant), kept "
                                    "redacted beside each request")
    max_user_turns: int = Field(default=8, gt=0, description="keep at most this many user turns per request")
    max_message_chars: int = Field(default=8000, gt=0, description="truncate longer messages (after redaction)")
    on_bad_record: Literal["fail", "skip"] = Field(default="fail", description="what a malformed line does: fail "
                                                   "the partition naming its file and line, or skip it and count it")


@dg.asset(group_name="serving", kinds={"parquet"}, partitions_def=traffic_partitions, deps=["prompts"],
          code_version=code_version(__name__, "traffic"))
def traffic(context: dg.AssetExecutionContext, config: TrafficConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """A day of the gateway's requests: at most max_prompts, a stable seeded sample, personal data redacted before
    anything is stored, free of near duplicates of each other and of every held-out prompt set."""
    sources = config.sources or [s.strip() for s in os.environ.get(LOGS_ENV, "").split(",") if s.strip()]
    if not sources:
        raise dg.Failure(description=f"no traffic sources: set the traffic asset's `sources` config, or {LOGS_ENV} "
                                     "(comma-separated paths or fsspec URLs of the gateway's request logs)")
    region = config.phone_region.upper()
    if region not in phonenumbers.SUPPORTED_REGIONS:
        raise dg.Failure(description=f"phone_region {config.phone_region!r} is no region phonenumbers knows: use an "
                                     "ISO 3166 code such as US, GB, DE, IN")
    wrote = upstream_metadata(context, "prompts")  # HumanEval only when include_humaneval
    held_out = [p for p, key in zip(HELD_OUT, ("eval_path", "eval_humaneval_path")) if wrote.get(key)]
    window, day = context.partition_time_window, context.partition_key
    redactor, stats, t0 = Redactor(region), TrafficStats(), time.monotonic()
    try:
        cands = read_day(sources, window.start, window.end, seed=config.seed,
                         keep=int(config.max_prompts * config.oversample), max_user_turns=config.max_user_turns,
                         on_bad_record=config.on_bad_record, timestamp_fields=config.timestamp_fields, stats=stats,
                         redactor=redactor, fields=config.group_fields)
        rows = redacted_rows(cands, redactor, config.max_message_chars, stats)
    except PromptError as e:  # redacted by read_day; `from None`: the raw one is not kept as its cause
        raise dg.Failure(description=str(e), allow_retries=False) from None
    del cands  # the raw text goes no further
    read_s = time.monotonic() - t0
    for p in stats.problems[:20]:
        context.log.warning(f"skipped: {p}")
    day_status = "read"
    if not stats.in_day:
        seen = sorted(stats.other_days)
        day_status = (f"empty: none of the {stats.records} requests read is of {day}" +
                      (f" (they are of {seen[0]} to {seen[-1]})" if seen else ""))
        context.log.warning(f"{day_status}: the partition is empty")

    rel_cands, rel_out = f"{TRAFFIC_DIR}/.candidates-{day}.parquet", f"{TRAFFIC_DIR}/{day}.parquet"
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "candidates.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=TRAFFIC_SCHEMA), local)
        gpu_host.put_file(str(local), rel_cands)
    here = gpu_host.bring(context, [Held("prompts", p) for p in held_out])
    run = gpu_host.run_stage(context, "traffic_sample", {
        "candidates": rel_cands, "held_out": [here[p] for p in held_out], "out": rel_out,
        "group_fields": config.group_fields,
        **config.model_dump(include=set(TrafficSampleSettings.model_fields))})
    files = [redactor.redact(u)[0] for u in stats.files_read]  # a URL may carry a key
    kept = (run.materialization.metadata or {}).get("prompts") if run.materialization else None
    kept, keep = getattr(kept, "value", kept), int(config.max_prompts * config.oversample)
    short = isinstance(kept, int) and kept < config.max_prompts and len(rows) == keep
    if short:  # the day had more requests than were redacted, and near duplicates took too many of those
        context.log.warning(f"only {kept} of max_prompts {config.max_prompts} kept: near duplicates took "
                            f"{keep - kept} of the {keep} candidates while the day held more requests; raise "
                            f"oversample (now {config.oversample:g}) for a full sample")
    return run.materialize_result(
        day=day, timezone=traffic_partitions.timezone, day_status=day_status,
        requests_read=stats.records, requests_in_day=stats.in_day,
        requests_other_days=sum(stats.other_days.values()), placed_by_file_name=stats.placed_by_file_name,
        bad_records_skipped=stats.bad_records_skipped, no_user_message=stats.no_user_message,
        exact_duplicates_dropped=stats.exact_duplicates, tool_messages_dropped=stats.tool_messages_dropped,
        empty_turns_dropped=stats.empty_turns_dropped, conversations_turn_capped=stats.turns_capped,
        messages_truncated=stats.messages_truncated, candidates_redacted=len(rows), sample_short=short,
        requests_with_served_figures=stats.with_served,
        **{f"redacted_{k}": stats.redacted[k] for k in KINDS}, redacted_total=sum(stats.redacted.values()),
        files_read=len(files), files_skipped_by_name=stats.files_skipped_by_name,
        sources_read=dg.MetadataValue.json(files[:100]), held_out_sets=dg.MetadataValue.json(held_out),
        read_and_redact_s=round(read_s, 3))
