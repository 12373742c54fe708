"""The serving loop: drift answered by a retrained challenger, a gate, a decision, a rollout.

- `retrain`: the newest traffic days into a challenger finetuned from the drafter in production;
- `promotion`: the promotion gate (champion and challenger served side by side) and the production record asset;
- `challenger_schedule`: the speculation schedule of a challenger the gate passed, before it is promoted;
- `production`: which drafter is in production per engine, and each decision (promote, roll back);
- `rollout`, `restart`: the drafter in production put on the running servers, one restart at a time;
- `on_drift`: the loop's jobs and the sensor that starts a retraining when drift is reported.
"""

from __future__ import annotations

import dagster as dg

from ..eye.servers_file import ServersFile
from .challenger_schedule import challenger_schedule
from .on_drift import build as build_retrain_sensor
from .on_drift import retrain_on_traffic_job, rollout_job
from .promotion import production_drafter, promotion_gate
from .retrain import challenger_drafter, challenger_export, retrain_conversations, retrain_data, retrain_shards
from .rollout import rollout

ASSETS = [retrain_data, retrain_conversations, retrain_shards, challenger_drafter, challenger_export, promotion_gate,
          challenger_schedule, production_drafter, rollout]


def definitions(servers: ServersFile | None) -> dg.Definitions:
    return dg.Definitions(assets=ASSETS, jobs=[retrain_on_traffic_job, rollout_job],
                          sensors=[build_retrain_sensor(servers)])
