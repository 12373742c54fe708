"""eagle3_drafter: the EAGLE-3 draft head trained on the hidden-state shards (stage `train`)."""

import dagster as dg

from ..code_versions import code_version
from ..hosts import GpuHost, Held
from ..stages.train import TrainSettings
from .partitions import shard_partitions
from .paths import DRAFTER_DIR, SHARDS_DIR, VOCAB
from .upstream import upstream_metadata


class DrafterConfig(dg.Config, TrainSettings):
    """The train stage's settings (eagle3_assets/stages/train.py). Pydantic checks their bounds as the step
    starts, before the asset runs anything: Dagster's config schema (what the launchpad checks) carries types
    only."""


def _shards(context: dg.AssetExecutionContext) -> list[Held]:
    keys = context.instance.get_dynamic_partitions(shard_partitions.name)
    done = context.instance.get_materialized_partitions(dg.AssetKey("hidden_state_shards"))
    missing = [k for k in keys if k not in done]
    if not keys or missing:
        raise dg.Failure(description=f"hidden_state_shards partitions {missing or '(none registered)'} are not "
                                     "materialized: backfill hidden_state_shards first")
    return [Held("hidden_state_shards", f"{SHARDS_DIR}/shard-{k}", partition=k) for k in keys]


@dg.asset(group_name="drafter", kinds={"pytorch"}, deps=["hidden_state_shards", "vocab_mapping", "target_model"],
          pool="gpu_host", code_version=code_version(__name__, "eagle3_drafter"))
def eagle3_drafter(context: dg.AssetExecutionContext, config: DrafterConfig, gpu_host: GpuHost) -> dg.MaterializeResult:
    """The trained EAGLE-3 draft head (canonical checkpoint under drafter/<run_name>/model). Data version =
    hash of the saved weights: every export and benchmark downstream names the exact checkpoint. In a pool of
    hosts it trains on the run's host, after copying there the shards other hosts hold."""
    target = upstream_metadata(context, "target_model")["path"]
    shards = _shards(context)
    here = gpu_host.bring(context, [*shards, Held("vocab_mapping", VOCAB), Held("target_model", target)])
    args = {"target": here[target], "shards": [here[s.path] for s in shards], "vocab": here[VOCAB],
            "out": f"{DRAFTER_DIR}/{config.run_name}", **config.model_dump()}
    return gpu_host.run_stage(context, "train", args).materialize_result()
