import hashlib
import json
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from .. import lineage
from ..code_versions import code_version
from ..common import charts
from ..common.engines import NAMES


def history_path(instance: dg.DagsterInstance) -> Path:
    """Beside the instance's own storage: the table is about Dagster's records, not the host's files."""
    return Path(instance.storage_directory()) / "eagle3" / "benchmark_history.parquet"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _table_md(rows: list[dict], last: int = 20) -> str:
    cols = ["when", "engine", "engine_version", "checkpoint", "acceptance_length", "speedup", "prompt_set"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows[-last:]:
        vals = {**r, "when": _when(r["when"]), "checkpoint": str(r["checkpoint"])[:12]}
        lines.append("| " + " | ".join(
            f"{vals[c]:.3f}" if isinstance(vals[c], float) and c != "when" else str(vals[c]) for c in cols) + " |")
    return "\n".join(lines)


def _history_chart(rows: list[dict], last: int = 12) -> str:
    """Acceptance length per engine over its results, each labelled with the checkpoint it measured."""
    parts = []
    for engine in sorted({r["engine"] for r in rows}):
        mine = [r for r in rows if r["engine"] == engine and r["acceptance_length"] is not None]
        if not mine:
            continue
        series = [float(r["acceptance_length"]) for r in mine]
        parts.append(f"**{engine}**: acceptance length over {len(series)} results `{charts.sparkline(series)}`\n\n"
                     + charts.bars([(f"{str(r['checkpoint'])[:12]} {_when(r['when'])}",
                                     float(r["acceptance_length"])) for r in mine[-last:]],
                                   vmax=max(series) * 1.1 or 1.0))
    return "\n\n".join(parts) or "no results yet"


@dg.asset(group_name="serving", kinds={"parquet"}, deps=["serving_benchmark"],
          code_version=code_version(__name__, "benchmark_history"))
def benchmark_history(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Every serving benchmark result with its lineage: engine and version, settings, acceptance length,
    per-position acceptance, speedup, and the checkpoint with the training config, vocab, shards,
    conversations, prompts and target behind it. `eagle3-assets lineage` prints it."""
    rows = lineage.history(context.instance)
    path = history_path(context.instance)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({"when": pa.array([], pa.float64())}), tmp)
    tmp.replace(path)
    meta = {"path": dg.MetadataValue.path(str(path)), "results": len(rows), "table": dg.MetadataValue.md(_table_md(rows)),
            "acceptance_history_chart": dg.MetadataValue.md(_history_chart(rows))}
    for engine in NAMES:  # the latest per engine, named so that Dagster plots them over time
        latest = [r for r in rows if r["engine"] == engine]
        if latest and latest[-1]["acceptance_length"] is not None:
            meta[f"acceptance_length_{engine}"] = float(latest[-1]["acceptance_length"])
        if latest and latest[-1]["speedup"] is not None:
            meta[f"speedup_{engine}"] = float(latest[-1]["speedup"])
    version = dg.DataVersion(hashlib.sha256(json.dumps([r["storage_id"] for r in rows]).encode()).hexdigest()[:32])
    return dg.MaterializeResult(metadata=meta, data_version=version)


class RegressionConfig(dg.Config):
    new_storage_id: int = Field(description="the benchmark materialization that dropped")
    old_storage_id: int = Field(description="the previous one with the same engine and settings")
    why: str = Field(default="", description="what dropped, by how much")


@dg.asset(group_name="serving", kinds={"dagster"}, deps=["serving_benchmark"],
          code_version=code_version(__name__, "benchmark_regression"))
def benchmark_regression(context: dg.AssetExecutionContext, config: RegressionConfig) -> dg.MaterializeResult:
    """A report, made by the regression sensor, of a benchmark that dropped against the previous one with
    the same engine and settings: the two results and what differs between their lineages."""
    old, new = (lineage.history_row(context.instance, lineage.record(context.instance, "serving_benchmark", sid))
                for sid in (config.old_storage_id, config.new_storage_id))
    diffs = lineage.differences(old, new) if config.old_storage_id != config.new_storage_id else \
        ["no earlier result of this engine to compare with: see the check's description"]
    report = "\n".join([f"**{config.why}**", "", "What differs between the two results' lineages:", ""]
                       + [f"- {d}" for d in diffs]
                       + ["", f"previous: run {old['run_id']}, checkpoint {str(old['checkpoint'])[:12]}, acceptance "
                              f"length {old['acceptance_length']}, speedup {old['speedup']}",
                          f"new: run {new['run_id']}, checkpoint {str(new['checkpoint'])[:12]}, acceptance length "
                          f"{new['acceptance_length']}, speedup {new['speedup']}"])
    context.log.warning(f"benchmark regression: {config.why}; " + "; ".join(diffs))
    return dg.MaterializeResult(metadata={
        "report": dg.MetadataValue.md(report), "changed": dg.MetadataValue.json(diffs), "why": config.why,
        "engine": new["engine"], "new_run": new["run_id"], "previous_run": old["run_id"]})
