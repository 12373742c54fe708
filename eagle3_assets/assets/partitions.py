import dagster as dg

from ..common.engines import NAMES

# One partition per serving engine (a module of worker/engines/): the benchmarks, the integration gate, the
# promotion gate and the rollout are each judged per engine.
engine_partitions = dg.StaticPartitionsDefinition(list(NAMES))

# One partition per hidden-state shard; the keys are registered by `conversations`, which knows how many
# samples there are. A failed shard reruns alone; shards can run in parallel (one per host slot).
shard_partitions = dg.DynamicPartitionsDefinition(name="hidden_state_shards")


def shard_key(shard: int) -> str:
    return f"{shard:05d}"
