
from typing import Literal

import dagster as dg
from pydantic import Field

from ..code_versions import code_version
from ..common.shard_format import bytes_per_token
from ..hosts import GpuHost
from ..stages.extract import ExtractSettings


class HostPreflightConfig(dg.Config):
    gpus: bool | None = Field(default=None, description="require GPUs (nvidia-smi must list one); empty: the "
                                                           "host's require_gpus")
    hidden_states_dtype: str = Field(default="bfloat16", description="dtype the shards will be extracted in")
    hidden_states_storage: Literal["native", "fp8"] = Field(
        default=ExtractSettings.model_fields["storage"].default, description="how they will be stored (the "
        "hidden_state_shards storage setting)")
    engines: list[str] = Field(default=[], description="engine checks against the current target, each "
                               "'<engine>:<purpose>': vllm:extract (hidden_state_shards backend vllm), "
                               "vllm:serve, sglang:serve; asked of the installed engine's own code")
    engine_python: str | None = Field(default=None, description="the host Python the engines are installed in")


def hidden_states_estimate(context: dg.AssetExecutionContext, dtype: str, storage: str) -> int | None:
    """Bytes the current conversations' hidden states take on disk, if conversations and target are known."""
    found = {}
    for name in ("conversations", "target_model"):
        ev = context.instance.get_latest_materialization_event(dg.AssetKey(name))
        if ev is None or ev.asset_materialization is None:
            return None
        found[name] = {k: v.value for k, v in ev.asset_materialization.metadata.items()}
    return int(found["conversations"]["total_tokens"]) * bytes_per_token(int(found["target_model"]["hidden_size"]), dtype,
                                                                        storage)


def check_engines(context: dg.AssetExecutionContext, gpu_host: GpuHost, config: HostPreflightConfig) -> dict:
    """Each configured engine check, run on the host against the current target: its version and answer in
    metadata; a Failure naming every engine that cannot do its job (the stage would refuse later anyway)."""
    ev = context.instance.get_latest_materialization_event(dg.AssetKey("target_model"))
    if ev is None or ev.asset_materialization is None:
        raise dg.Failure(description="engine checks need the target: materialize target_model first")
    target = ev.asset_materialization.metadata["path"].value
    out, failed = {}, []
    for spec in config.engines:
        engine, _, purpose = spec.partition(":")
        try:
            run = gpu_host.run_stage(context, "engine_check", {"engine": engine, "purpose": purpose or "serve",
                                                               "target": target, "engine_python": config.engine_python})
            out[f"{engine}_{purpose}_supported"] = True
            out[f"{engine}_version"] = run.result.get("version", "")
        except dg.Failure as e:
            out[f"{engine}_{purpose}_supported"] = False
            failed.append(f"{spec}: {e.description}")
    if failed:
        raise dg.Failure(description="the host's engines cannot do what is asked of them:\n- " + "\n- ".join(failed),
                         allow_retries=False)
    return out


@dg.asset(group_name="host", kinds={"ssh"}, code_version=code_version(__name__, "host_preflight"))
def host_preflight(context: dg.AssetExecutionContext, config: HostPreflightConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """Is the GPU host ready? It answers; its Python has the worker's dependencies and the control plane's
    worker code; nvidia-smi lists GPUs; its free disk covers the hidden states the current conversations
    will need. Cheap: materialize it before a long job, or after changing the host."""
    need = hidden_states_estimate(context, config.hidden_states_dtype, config.hidden_states_storage)
    need_gpus = gpu_host.require_gpus if config.gpus is None else config.gpus
    info = gpu_host.check(context, gpus=need_gpus, need_bytes=need)
    gpus = info.get("gpus") or []
    engines = check_engines(context, gpu_host, config) if config.engines else {}
    return dg.MaterializeResult(metadata={
        **engines,
        "hostname": info["hostname"],
        "python": info["python"],
        "executable": info["executable"],
        "worker_deps": dg.MetadataValue.json(info["deps"]),
        "gpu_count": len(gpus),
        "gpus": dg.MetadataValue.json(gpus),
        "free_disk_gb": round(info["disk"]["free_bytes"] / 1e9, 2),
        **({"hidden_states_estimate_gb": round(need / 1e9, 3)} if need is not None else {}),
        "workdir": dg.MetadataValue.path(info["workdir"]),
    })
