"""drafter_export: the trained drafter in the formats the serving engines load (stage `export`)."""

import dagster as dg

from ..code_versions import code_version
from ..hosts import GpuHost
from ..stages.export import ExportSettings
from .paths import EXPORT_DIR
from .upstream import upstream_metadata


class ExportConfig(dg.Config, ExportSettings):
    """The export stage's settings (eagle3_assets/stages/export.py)."""


@dg.asset(group_name="drafter", kinds={"safetensors"}, deps=["eagle3_drafter", "target_model"],
          code_version=code_version(__name__, "drafter_export"))
def drafter_export(context: dg.AssetExecutionContext, config: ExportConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The drafter as vLLM and SGLang load it (exports/<version>/{vllm,sglang}), each validated against its
    contract: names, shapes, dtypes, config fields, and which target layers the engine will capture."""
    drafter = upstream_metadata(context, "eagle3_drafter")
    target = upstream_metadata(context, "target_model")["path"]
    version = context.instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter")).asset_materialization.tags.get(
        "dagster/data_version", "latest")
    run = gpu_host.run_stage(context, "export", {"drafter": drafter["path"], "target": target,
                                                 "out": f"{EXPORT_DIR}/{version[:12]}", **config.model_dump()})
    return run.materialize_result()
