"""The serving eye's one file (`EAGLE3_SERVERS`): the production servers it watches, how often, and when their
acceptance counts as drift. Read when the code location loads; a bad file fails the load naming the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import dagster as dg
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..common.secrets import scrub
from ..stages.base import plain_name

SERVERS_ENV = "EAGLE3_SERVERS"
ASSET_PREFIX = "live_acceptance"
DEFAULT_INTERVAL_S = 60


class Server(BaseModel):
    """One production server the eye watches."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="a plain name: the asset live_acceptance/<name>")
    url: str = Field(description="the server's base URL, e.g. http://10.0.0.5:8000 (its /metrics and API)")
    engine: Literal["vllm", "sglang"] = "vllm"
    drafter: str | None = Field(default=None, description="the drafter it serves (an export's path on the host), "
                                "where the server does not tell: vLLM says it only with VLLM_SERVER_DEV_MODE=1")
    benchmark_acceptance_length: float | None = Field(
        default=None, gt=1, description="the drafter's benchmarked acceptance length, for a drafter this instance "
        "never benchmarked (one trained elsewhere); else read from its serving_benchmark")
    timeout_s: float = Field(default=5.0, gt=0)
    restart: list[str] | None = Field(default=None, description="how a rollout puts another drafter on this server: a "
                                      "command run on the Dagster machine, {drafter} replaced by the export's path "
                                      "and {speculative_config} by the path of its speculation schedule's config "
                                      "(e.g. [systemctl, restart, 'vllm@{drafter}'], or a script around kubectl); "
                                      "None: the server is left to you")
    restart_timeout_s: float = Field(default=600.0, gt=0, description="a restart command still running after this "
                                     "long is killed (its whole process group) and the server rolled back")
    ready_timeout_s: float = Field(default=900.0, gt=0, description="a rollout waits this long for the server to "
                                   "answer /health after its restart")

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str) -> str:
        return plain_name(v)

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.username is not None or parts.password is not None:  # the URL is shown in every observation
            raise ValueError(f"the URL of {parts.hostname} carries credentials "
                             "(user:password@, not shown): the URL is stored in every observation and shown in the "
                             "UI; give the bare URL and put credentials elsewhere (a proxy or the network in front "
                             "of the server, never this file)")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"{scrub(repr(v))} is not an http(s) URL: give the server's base URL, e.g. http://127.0.0.1:8000")
        return v.rstrip("/")


class DriftSettings(BaseModel):
    """When acceptance counts as drift (drift.py): the two signals' thresholds and the live signal's window."""

    model_config = ConfigDict(extra="forbid")
    window_s: int = Field(default=900, ge=10, description="the live signal's window: the acceptance of the last "
                          "window_s seconds of a server's observations, over every draft in them")
    min_drafts: int = Field(default=200, gt=0, description="a window with fewer speculative steps is not judged")
    live_drop: float = Field(default=0.10, gt=0, lt=1, description="live signal: the window's acceptance length "
                             "below the drafter's benchmarked figure by more than this fraction")
    offline_drop: float = Field(default=0.10, gt=0, lt=1, description="offline signal: the drafter's acceptance on "
                                "the newest traffic below its figure on its eval set by more than this fraction")
    report_every_s: int = Field(default=86400, ge=0, description="a drift that lasts is reported again after this "
                                "long (0: only when it starts)")
    locate: bool = Field(default=True, description="a live drift's report replays the newest traffic partition "
                         "(traffic_acceptance) to say where acceptance fell: a few minutes of the host, once per drift")
    locate_from: Literal["auto", "served", "replay", "both"] = Field(default="auto", description="where a live "
                                                                 "drift's report locates the fall: served, the "
                                                                 "acceptance production served per request (a gateway "
                                                                 "log with responses and vLLM's per-request metrics; "
                                                                 "no host work); replay, our replay of the day on the "
                                                                 "host; both; auto: served when the newest traffic "
                                                                 "day held served figures, else replay")
    replay_limit: int = Field(default=48, gt=0, description="traffic prompts a report's replay takes")
    offline_interval_s: int = Field(default=600, ge=10, description="how often the traffic drift sensor looks for a "
                                    "new traffic day (when it is turned on)")
    collapse_ratio: float = Field(default=0.25, gt=0, lt=1, description="a window (of min_drafts steps or more) "
                                  "whose first draft position is accepted at most this fraction as often as on the "
                                  "drafter's benchmark is a suspected collapse (the first position's acceptance is "
                                  "the same at every k): the drift report tells a collapse of the server's integration "
                                  "(an error, never retrained) from traffic the drafter never saw (drift)")
    collapse_below: float = Field(default=1.1, ge=1, description="where the benchmark gives no figure per position: "
                                  "a window whose first draft position is accepted on at most collapse_below - 1 of "
                                  "its steps (1.1: 10 %) is a suspected collapse")
    probe_prompts: int = Field(default=4, ge=0, description="a suspected collapse's report sends this many prompts "
                               "of the drafter's benchmark to the server (greedy, probe_tokens each): accepted as on "
                               "the benchmark, the server's integration works and the traffic moved (drift); near "
                               "nothing, a collapse. 0: no probes (the served config and the traffic's kinds judge)")
    probe_tokens: int = Field(default=32, gt=0, description="tokens each probe asks for")
    unjudged_after_s: int = Field(default=3600, ge=0, description="a server whose live acceptance could not be judged "
                                  "for this long (no reference figure, too few steps, another k) is reported: its "
                                  "check turns from a warning to an error (0: never)")


class ServersFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    servers: list[Server] = Field(min_length=1)
    interval_s: int = Field(default=DEFAULT_INTERVAL_S, ge=5, description="seconds between two reads of a server")
    drift: DriftSettings = Field(default_factory=DriftSettings)


def load_servers(path: str) -> ServersFile:
    where = f"servers file {path}" + (f" ({SERVERS_ENV})" if os.environ.get(SERVERS_ENV) == path else "")
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise ValueError(f"{where} cannot be read: {e.strerror}") from None
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark
        raise ValueError(f"{where} is not valid YAML: line {m.line + 1 if m else '?'}: {e.problem}") from None
    try:
        parsed = ServersFile.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(file)'}: {err['msg']}" for err in e.errors())
        # every message quoting a value goes through scrub: it reaches the daemon log, the sensors' stored skip
        # reasons and descriptions (schedules.db, the UI)
        raise ValueError(scrub(f"{where}: {bad}") + " (expected servers: [{name, url, engine, drafter}], interval_s, "
                         "drift: {window_s, min_drafts, live_drop, offline_drop, ...})") from None
    names = [s.name for s in parsed.servers]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: server names must differ: {sorted({n for n in names if names.count(n) > 1})}")
    return parsed


def asset_key(name: str) -> dg.AssetKey:
    return dg.AssetKey([ASSET_PREFIX, name])


def drift_settings() -> DriftSettings:
    """The drift section of the servers file (EAGLE3_SERVERS), else the defaults: what the offline signal's check
    holds a replay to, with or without servers to watch."""
    path = os.environ.get(SERVERS_ENV)
    return load_servers(path).drift if path else DriftSettings()
