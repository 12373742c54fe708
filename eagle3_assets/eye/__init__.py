"""The serving eye: what the production servers serve and how well, watched from the Dagster machine.

- `servers_file`: the one file (EAGLE3_SERVERS) naming the servers, how often they are read, what counts as drift;
- `live_acceptance`: each server's own spec-decode counters, one observation per window (an asset per server);
- `served`, `served_lineage`: a served drafter tied to this instance's records (its checkpoint, its figures);
- `traffic`, `traffic_acceptance`: the gateway's requests per day, redacted, and the drafter replayed on them;
- `traffic_days`: each finished day read on its own (a daily schedule, on when the logs are set);
- `drift`, `drift_report`: the two drift signals and the report a drift run makes.
"""

from __future__ import annotations

import dagster as dg

from .drift import build as build_drift
from .drift import check_traffic_job, drift_report_job
from .drift_report import make_drift_report
from .live_acceptance import build as build_live_acceptance
from .servers_file import ServersFile
from .traffic import traffic
from .traffic_acceptance import traffic_acceptance
from .traffic_days import read_traffic_daily, read_traffic_job

# The eye's assets as the graph has them with no servers file: drift_report without live assets upstream
ASSETS = [traffic, traffic_acceptance, make_drift_report([])]


def definitions(servers: ServersFile | None, refused: str | None = None) -> dg.Definitions:
    """The eye for these servers: an asset per server, the sensor reading them, the drift sensors and the live
    check, the drift report with each server's asset upstream. `refused`: why the servers file was not read (the
    eye then watches nothing, and its live_acceptance_sensor says why on every tick)."""
    live_specs, live_sensors = build_live_acceptance(servers, refused)
    drift_sensors, drift_checks = build_drift(servers)
    return dg.Definitions(
        assets=[traffic, traffic_acceptance, make_drift_report([s.key for s in live_specs]), *live_specs],
        asset_checks=drift_checks, jobs=[check_traffic_job, drift_report_job, read_traffic_job],
        schedules=[read_traffic_daily], sensors=[*live_sensors, *drift_sensors])
