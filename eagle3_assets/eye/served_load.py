"""The load mix the engine's production servers served over the last hours, from the serving eye's observations
(each window's mean batch and output tokens, live_acceptance.py): what the promotion gate weighs its speedups by."""

from __future__ import annotations

import os
import time

import dagster as dg

from ..common import load_mix
from . import served
from .servers_file import SERVERS_ENV, load_servers


def observed(instance: dg.DagsterInstance, engine: str, hours: float, max_levels: int = 3) -> tuple[dict, str]:
    """(mix, where it came from). {} and why when nothing was observed: no servers file, no server of the engine in
    it, or no window with output and load figures (a server that is not vLLM)."""
    path = os.environ.get(SERVERS_ENV)
    if not path:
        return {}, f"no servers file ({SERVERS_ENV}): no production load observed"
    try:
        names = [s.name for s in load_servers(path).servers if s.engine == engine]
    except ValueError as e:
        return {}, f"the servers file cannot be read ({e}): no production load observed"
    if not names:
        return {}, f"no {engine} server in the servers file: no production load observed"
    since = time.time() - hours * 3600
    windows = [(float(o.get("mean_requests_running") or 0), float(o.get("generation_tokens") or 0))
               for name in names for o in served.observations(instance, name, since=since)
               if o.get("mean_requests_running") is not None and o.get("generation_tokens") is not None]
    mix = load_mix.from_windows(windows, max_levels=max_levels)
    if not mix:
        return {}, (f"no output with load figures from {', '.join(names)} in the last {hours:g} h: no production "
                    "load observed")
    tokens = int(sum(t for _, t in windows))
    return mix, (f"observed on {', '.join(names)} over the last {hours:g} h ({len(windows)} windows, {tokens} output "
                 f"tokens): {load_mix.describe(mix)}")
