import hashlib
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Literal

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from ..code_versions import code_version
from ..common.prompts_table import PROMPTS_SCHEMA
from ..hosts import GpuHost
from ..sources.prompt_files import BUNDLED, LoadStats, PromptError, humaneval, load_source, split
from .paths import EVAL, EVAL_HUMANEVAL, TRAIN

# Prompt sets acceptance is measured on; `train` is a sanity check (a drafter must do well on its own data).



class PromptsConfig(dg.Config):
    sources: list[str] = Field(default=[BUNDLED], min_length=1, description="'bundled', 'single-turn' and/or paths "
                               "or fsspec URLs of ShareGPT, UltraChat or OpenAI-messages files (.json, .jsonl, "
                               ".parquet, optionally .gz)")
    eval_fraction: float = Field(default=0.05, ge=0, lt=1, description="share held out for evaluation (never trained on)")
    max_user_turns: int = Field(default=8, gt=0, description="keep at most this many user turns per conversation")
    max_message_chars: int = Field(default=8000, gt=0, description="truncate longer messages")
    max_train_conversations: int | None = Field(default=None, gt=0, description="cap on the training split")
    include_humaneval: bool = Field(default=True, description="also write HumanEval's 164 prompts as an eval set")
    on_bad_record: Literal["fail", "skip"] = Field(default="fail", description="what a malformed record does")


def prompts_table(convs) -> pa.Table:
    return pa.Table.from_pylist(
        [{"id": c.id, "source": c.source, "messages": c.messages,
          "num_user_turns": sum(m["role"] == "user" for m in c.messages)} for c in convs], schema=PROMPTS_SCHEMA)


@dg.asset(group_name="data", kinds={"parquet"}, code_version=code_version(__name__, "prompts"))
def prompts(context: dg.AssetExecutionContext, config: PromptsConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """Conversations to regenerate, deduplicated and cleaned, split into train and a held-out eval set
    (plus HumanEval). Only `prompts/train.parquet` feeds training assets."""
    if not 0.0 <= config.eval_fraction < 1.0:
        raise dg.Failure(description=f"eval_fraction must be in [0, 1), got {config.eval_fraction}")
    stats, seen, convs, dupes = LoadStats(), set(), [], 0
    try:
        for source in config.sources:
            for conv in load_source(source, max_user_turns=config.max_user_turns,
                                    max_message_chars=config.max_message_chars,
                                    on_bad_record=config.on_bad_record, stats=stats):
                if conv.key in seen:
                    dupes += 1
                    continue
                seen.add(conv.key)
                convs.append(conv)
        extra_eval = humaneval() if config.include_humaneval else []
    except PromptError as e:
        raise dg.Failure(description=str(e), allow_retries=False) from e
    for p in stats.problems[:20]:
        context.log.warning(f"skipped: {p}")
    if not convs:
        raise dg.Failure(description=f"no usable conversations in {config.sources}")

    train, evals = split(convs, config.eval_fraction, config.max_train_conversations)
    if not train:
        raise dg.Failure(description="every conversation went to the eval split: lower eval_fraction or add prompts")

    # Every source is read and every table built before the host's files are touched; each upload lands under
    # a temporary name and is renamed into place (put_file). train.parquet, which conversations reads, goes
    # last: a failed upload leaves it as it was (the split is by hash, so an old train and a new eval of the
    # same eval_fraction never share a conversation).
    tables = [(EVAL_HUMANEVAL, prompts_table(extra_eval))] if extra_eval else []
    tables += [(EVAL, prompts_table(evals)), (TRAIN, prompts_table(train))]
    with tempfile.TemporaryDirectory() as tmp:
        for rel, table in tables:
            pq.write_table(table, Path(tmp) / Path(rel).name)
        for rel, _ in tables:
            gpu_host.put_file(str(Path(tmp) / Path(rel).name), rel)

    version = hashlib.sha256(json.dumps([[c.id, c.messages] for c in train], ensure_ascii=False).encode()).hexdigest()
    by_source = Counter(c.source for c in train)
    preview = "\n".join(f"- `{c.source}` {c.messages[0]['content'][:100]!r}" for c in train[:5])
    return dg.MaterializeResult(
        metadata={
            "train_path": dg.MetadataValue.path(TRAIN),
            "eval_path": dg.MetadataValue.path(EVAL),
            "eval_humaneval_path": dg.MetadataValue.path(EVAL_HUMANEVAL if extra_eval else ""),
            "train_conversations": len(train),
            "eval_conversations": len(evals),
            "humaneval_eval_conversations": len(extra_eval),
            "records_read": stats.records,
            "duplicates_dropped": dupes,
            "empty_turns_dropped": stats.empty_turns_dropped,
            "messages_truncated": stats.messages_truncated,
            "conversations_turn_capped": stats.turns_capped,
            "bad_records_skipped": stats.bad_records_skipped,
            "train_by_source": dg.MetadataValue.json(dict(by_source)),
            "multi_turn_share": round(sum(sum(m["role"] == "user" for m in c.messages) > 1 for c in train) / len(train), 4),
            "dagster/row_count": len(train),
            "preview": dg.MetadataValue.md(preview),
        },
        data_version=dg.DataVersion(version[:32]),
    )
