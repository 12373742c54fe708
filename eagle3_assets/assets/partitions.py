import dagster as dg

# One partition per hidden-state shard; the keys are registered by `conversations`, which knows how many
# samples there are. A failed shard reruns alone; shards can run in parallel (one per host slot).
shard_partitions = dg.DynamicPartitionsDefinition(name="hidden_state_shards")


def shard_key(shard: int) -> str:
    return f"{shard:05d}"
