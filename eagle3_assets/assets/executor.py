"""How the jobs the sensors and schedules launch execute their steps."""

import dagster as dg

# In the run's own process, one step after another. Each of these jobs is one step or one chain of steps, so a
# process per step (Dagster's default) buys no parallelism, and costs ~4 s of imports per step on a 2-core control
# plane: time between a drift and its report, or a failed host and its shard's failover. The heavy work of every
# step runs on the host, in processes of its own, either way.
ONE_PROCESS = dg.in_process_executor
