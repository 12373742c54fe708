"""`eagle3-assets lineage --served`: per production server, the drafter it serves and everything this instance knows
of it: the checkpoint it was exported from, that checkpoint's serving benchmarks, the server's live acceptance over
the last day, and the drift reports against it."""

from __future__ import annotations

import os
import time

import dagster as dg

from ..common import charts
from . import served
from .servers_file import ASSET_PREFIX, SERVERS_ENV, Server, load_servers

REPORT = dg.AssetKey("drift_report")
DAY_S = 86400


def _when(ts: float, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return time.strftime(fmt, time.localtime(ts))


def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _servers(instance: dg.DagsterInstance) -> list[Server]:
    """The servers file's, else every server this instance has live figures of."""
    if os.environ.get(SERVERS_ENV):
        return load_servers(os.environ[SERVERS_ENV]).servers
    keys = instance.get_asset_keys(prefix=[ASSET_PREFIX])
    out = []
    for key in sorted(keys, key=lambda k: k.path):
        obs = served.observations(instance, key.path[-1], limit=1)
        url = str(obs[-1].get("url", "http://unknown")) if obs else "http://unknown"
        engine = str(obs[-1].get("engine", "vllm")) if obs else "vllm"
        try:
            out.append(Server(name=key.path[-1], url=url, engine=engine))
        except ValueError:  # a URL the servers file now refuses (not http, or with credentials): not shown
            out.append(Server(name=key.path[-1], url="http://unknown", engine=engine))
    return out


def reports_against(instance: dg.DagsterInstance, server: str, drafter: str | None) -> list[dict]:
    """drift_report materializations about this server, or about its drafter, oldest first."""
    out = []
    for rec in reversed(instance.fetch_materializations(REPORT, limit=500).records):
        m = served.meta(rec)
        if m.get("server") == server or (drafter and m.get("drafter") == drafter):
            out.append({"when": rec.timestamp, **m})
    return out


def show_served(instance: dg.DagsterInstance, engine: str | None = None) -> int:
    servers = [s for s in _servers(instance) if engine is None or s.engine == engine]
    if not servers:
        print(f"no production servers: list them in a YAML file named by {SERVERS_ENV} (docs: the serving eye)")
        return 0
    now = time.time()
    for s in servers:
        obs = served.observations(instance, s.name, since=now - DAY_S)
        drafter = served.serving_now(obs) or served.serving_now(served.observations(instance, s.name, limit=50)) \
            or s.drafter
        ckpt = served.checkpoint(instance, drafter)
        print(f"server {s.name} ({s.engine}, {s.url})")
        print(f"  drafter {drafter or 'unknown'}")
        print(f"  checkpoint {ckpt or 'not exported by this instance'}")
        bench = served.benchmarks(instance, ckpt)
        print("  benchmarks of this checkpoint:" if bench else "  benchmarks of this checkpoint: none")
        for b in bench[:5]:
            print(f"    {_when(b['when'])}  {b['engine']} {b['engine_version']}  AL {_f(b['acceptance_length'])}  "
                  f"speedup {_f(b['speedup'], '{:.2f}x')}  k {b['num_speculative_tokens']}  on {b['prompt_set']}")
        mine = [o for o in obs if o.get("acceptance_length") is not None and o.get("drafter") == drafter]
        if mine:
            values = [float(o["acceptance_length"]) for o in mine]
            drafts = sum(int(o.get("num_drafts") or 0) for o in mine)
            print(f"  live, last day: {len(mine)} windows, {drafts} speculative steps; AL {charts.sparkline(values)} "
                  f"first {values[0]:.3f}, last {values[-1]:.3f}, min {min(values):.3f}, max {max(values):.3f}")
            for o in mine[-5:]:
                print(f"    {_when(o['t'], '%H:%M:%S')}  AL {float(o['acceptance_length']):.3f}  drafts "
                      f"{o.get('num_drafts')}  {o.get('status')}")
        else:
            last = obs[-1]["status"] if obs else "no observation"
            print(f"  live, last day: no window with speculative steps ({last})")
        reports = reports_against(instance, s.name, drafter)
        print("  drift reports against it:" if reports else "  drift reports against it: none")
        for r in reports[-10:]:
            live = (f"live {_f(r.get('live_acceptance_length'))} vs benchmark {_f(r.get('benchmark_acceptance_length'))}"
                    f" ({-float(r['live_drop']):+.1%})" if r.get("live_drop") is not None else "")
            off = (f"traffic {_f(r.get('traffic_acceptance_length'))} vs eval {_f(r.get('eval_acceptance_length'))}"
                   if r.get("traffic_acceptance_length") is not None else "")
            print(f"    {_when(r['when'])}  fired: {r.get('signals_fired')}  " + "  ".join(x for x in (live, off) if x)
                  + f"  where: {r.get('where', '-')}")
    return 0
