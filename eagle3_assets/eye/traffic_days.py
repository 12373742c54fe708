"""Traffic days on their own: each finished day of the gateway's logs read into its `traffic` partition by a daily
schedule, on by default when EAGLE3_TRAFFIC_LOGS names the logs (off without: there is nothing to read), so the
offline drift signal, the reports and the retraining find yesterday's traffic without anyone materializing it.
The same job reads today so far when a drift waits for traffic (the loop's retrain_on_drift_sensor)."""

import os
from datetime import timedelta

import dagster as dg

from ..assets.executor import ONE_PROCESS
from .traffic import LOGS_ENV, traffic_partitions

READ_AT = "30 0 * * *"  # half past midnight where days begin: the day before is finished

read_traffic_job = dg.define_asset_job(
    "read_traffic", selection=["traffic"], partitions_def=traffic_partitions, executor_def=ONE_PROCESS,
    description="a day of traffic read from the gateway's logs: each finished day (read_traffic_daily), or today "
                "so far for a drift whose retraining waits for traffic")


def finished_day(scheduled) -> str:
    """The traffic partition of the day before a tick (its time in the partitions' timezone)."""
    return (scheduled - timedelta(days=1)).strftime(traffic_partitions.fmt)


@dg.schedule(name="read_traffic_daily", job=read_traffic_job, cron_schedule=READ_AT,
             execution_timezone=traffic_partitions.timezone,
             default_status=dg.DefaultScheduleStatus.RUNNING if os.environ.get(LOGS_ENV)
             else dg.DefaultScheduleStatus.STOPPED,
             description=f"each finished day of the gateway's logs ({LOGS_ENV}) into its traffic partition; on by "
                         "default when the logs are set. A day with no requests is materialized empty "
                         "(day_status), logs that cannot be read fail the day's run naming them")
def read_traffic_daily(context: dg.ScheduleEvaluationContext):
    day = finished_day(context.scheduled_execution_time)
    return dg.RunRequest(run_key=f"traffic-{day}", partition_key=day)
