"""`eagle3-assets serving-loop`: the README's second story, on the instance the main command left.

The drafter in production (the newest drafter_export, promoted by hand if nothing is) serves as a vLLM server
started here under a pid file (worker/serving/prod_server.py, its restart command in the servers file); a gateway (gateway.py)
sends it held-out probes of a new kind of traffic (French, Spanish and German questions: the shipped drafter was
trained on English chat) and measures the live acceptance on them; then a day of that traffic, which the serving
eye's live signal reports as drift. The team's switch, `retrain_on_drift_sensor`, is turned on for one retraining:
the real daemon runs `retrain_on_traffic` (the traffic into a challenger, the gate, the promotion, the rollout by
restart); the probes again give the live acceptance after. Everything is recorded in the instance: the UI and
`eagle3-assets production` / `lineage --served` show it afterwards. The servers and the daemon it started are
stopped at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import dagster as dg
import yaml

from ..common.ports import free_port
from ..eye import served
from ..loop import production
from .daemon import settle_runs, start_daemon, stop_daemon
from .gateway import OTHER_LANGUAGES, Gateway, other_language_prompts

ENGINE = "vllm"
PROBES = 10  # prompts of the new kind kept out of the traffic, measured live before and after
SERVER = [sys.executable, "-m", "eagle3_assets.worker.serving.prod_server"]  # the serving machine's service manager
# the serving eye as the story runs it: a scrape every 5 s; drift judged over 45 s windows of at least 100 steps
EYE = {"interval_s": 5, "drift": {"window_s": 45, "min_drafts": 100, "locate": False}}


@dataclass
class Story:
    before: float | None = None  # live acceptance on the probes, the champion serving
    after: float | None = None  # ... the drafter rolled out
    champion: str = ""
    production: dict = field(default_factory=dict)
    run_id: str = ""
    run_status: str = ""
    steps_s: dict = field(default_factory=dict)
    marks: dict = field(default_factory=dict)  # seconds since the start at each step of the story


class Loop:
    """The story's moving parts on one instance: its servers, the daemon, the gateway, and the waits."""

    def __init__(self, home: Path, workdir: Path, log: Callable[[str], None], workspace: Path | None = None,
                 cwd: Path | None = None):
        self.home, self.workdir, self.log, self.workspace, self.cwd = home, workdir, log, workspace, cwd
        self.instance = dg.DagsterInstance.from_config(str(home))
        self.daemon = None
        self.t0 = time.time()
        self.marks: dict[str, float] = {}

    def mark(self, what: str) -> None:
        self.marks[what] = round(time.time() - self.t0, 1)
        self.log(f"==> {what} ({self.marks[what]:.0f} s)")

    def cli(self, *argv: str, location: bool = True) -> str:
        """A `dagster` command; `location`: aimed at the daemon's code location (a sensor's state is kept per
        location), else at the definitions module (`dagster asset materialize` takes no workspace)."""
        where = ["-w", str(self.workspace)] if self.workspace and location else ["-m", "eagle3_assets.definitions"]
        done = subprocess.run([*argv, *where], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr[-2000:]}")
        return done.stdout

    def wait(self, what: str, fetch, timeout_s: float, every_s: float = 2):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = fetch()
            if got:
                return got
            if self.daemon is not None and self.daemon.poll() is not None:
                raise RuntimeError(f"the daemon exited while waiting for {what}: see {self.workdir / 'daemon.log'}")
            time.sleep(every_s)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def live(self, name: str, drafter: str, since: float, until: float) -> float | None:
        """The acceptance length over every step the serving eye saw `name` make with `drafter` since `since`, once it
        has read the server at or after `until` (the last probe answered): None before, so a wait counts every probe,
        not the first read's share of them."""
        obs = served.observations(self.instance, name, since=since, limit=1000)
        # an observation is stored as its tick ends, a moment after it read the server: 2 s covers that lag
        if not any(o["t"] >= until + 2 for o in obs):
            return None
        return served.window(obs, drafter, since)["acceptance_length"]

    def start(self, servers: list[dict], env: dict) -> None:
        (self.workdir / "servers.yaml").write_text(yaml.safe_dump({**EYE, "servers": servers}))
        self.env = {**os.environ, "DAGSTER_HOME": str(self.home), "EAGLE3_SERVERS": str(self.workdir / "servers.yaml"),
                    **env}
        self.daemon = start_daemon(self.env, self.workdir / "daemon.log", self.workspace, self.cwd)

    def stop(self) -> None:
        """The daemon stopped with its run workers (its process group); a run its sensors started that had not ended
        is marked canceled, and one the stop failed is not retried, so the next daemon on this instance neither
        launches nor retries it (the eye's sensor reports a drift whose report was not made again, if it still
        holds: a retried report would start a retraining there). Runs others launched are left alone."""
        stop_daemon(self.daemon)
        settle_runs(self.instance, self.t0, self.log)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:  # noqa: S310 (127.0.0.1)
            return r.status == 200
    except OSError:
        return False


def _timeline(instance: dg.DagsterInstance, run_id: str) -> dict[str, float]:
    """Seconds per step of a run, from its start to its success or failure."""
    start, took = {}, {}
    for e in instance.all_logs(run_id):
        ev = e.dagster_event
        if ev is None or not ev.step_key:
            continue
        if ev.is_step_start:
            start[ev.step_key] = e.timestamp
        elif (ev.is_step_success or ev.is_step_failure) and ev.step_key in start:
            took[ev.step_key] = round(e.timestamp - start[ev.step_key], 1)
    return took


def restart_command(d: Path, port: int, target: str, *extra: str) -> list[str]:
    """The restart command a servers file lists for a server kept in `d` ({drafter}: the rollout's export)."""
    return [*SERVER, "restart", "--dir", str(d), "--port", str(port), "--target", target, "--drafter", "{drafter}",
            *extra]


def retrain_config() -> dict:
    return yaml.safe_load(resources.files("eagle3_assets").joinpath("presets/serving_loop_cpu.yaml").read_text())


def champion(instance: dg.DagsterInstance, log) -> dict:
    """The drafter in production on vLLM; the newest drafter_export promoted by hand when there is none."""
    now = production.current(instance, ENGINE)
    if now is None:
        meta = production.decision(ENGINE, production.export_of(instance), "promoted by hand",
                                   "the main command's drafter, served by the second story", None)
        production.report(instance, ENGINE, meta)
        log(f"promoted the newest drafter_export into production on {ENGINE}: {meta['version'][:12]}")
        now = production.current(instance, ENGINE)
    return now


def run(home: Path, workdir: Path, *, log: Callable[[str], None] = print, name: str = "prod",
        extra_servers: tuple[dict, ...] = (), env: dict | None = None, workspace: Path | None = None,
        cwd: Path | None = None, timeout_s: float = 3600, kind: str = "fr-es-de", retrain: dict | None = None) -> Story:
    """The story on the instance at `home` (its host files where its definitions put them, or where `env`'s
    EAGLE3_HOST_WORKDIR says); `name`: the production server's; `extra_servers`: more servers of the servers file
    (a canary, say), started by their restart command with the champion; `kind`: the new kind of traffic (gateway.py's
    KINDS: run it again with another kind for the loop's next turn, judged against the drafter the last promoted);
    `retrain`: the run config of the retraining (default: presets/serving_loop_cpu.yaml)."""
    workdir.mkdir(parents=True, exist_ok=True)
    loop = Loop(home, workdir, log, workspace, cwd)
    inst = loop.instance
    target_rec = inst.get_latest_materialization_event(dg.AssetKey("target_model"))
    if target_rec is None:
        raise RuntimeError("no target_model in this instance: run the main command first (`eagle3-assets materialize`)")
    target = str(target_rec.asset_materialization.metadata["path"].value)
    champ = champion(inst, log)
    story = Story(champion=champ["export_path"])
    port = free_port()
    servers = [{"name": name, "url": f"http://127.0.0.1:{port}", "engine": ENGINE, "drafter": champ["export_path"],
                "restart": restart_command(workdir / name, port, target)}, *extra_servers]
    gateway_log = workdir / "gateway" / "requests.jsonl"
    gateway_log.parent.mkdir(exist_ok=True)
    (workdir / "retrain.yaml").write_text(yaml.safe_dump(retrain or retrain_config()))
    try:
        for s in servers:
            subprocess.run([c.replace("{drafter}", champ["export_path"]) for c in s["restart"]], check=True)
        loop.start(servers, {"EAGLE3_TRAFFIC_LOGS": str(gateway_log),
                             "EAGLE3_RETRAIN_CONFIG": str(workdir / "retrain.yaml"), **(env or {})})
        for s in servers:
            loop.wait(f"{s['name']} to answer {s['url']}/health", lambda u=s["url"]: _healthy(u), 900)
        loop.mark(f"the servers serve the drafter in production ({champ['version'][:12]})")
        gw = Gateway(servers[0]["url"], gateway_log)
        new_kind = other_language_prompts(500, kind) + (OTHER_LANGUAGES if kind == "fr-es-de" else [])
        # probes: a monitor's requests, not the gateway's traffic (unlogged), so no retraining ever sees them
        probes, new_kind = new_kind[:PROBES], new_kind[PROBES:]
        t = t_probes = time.time()
        for text in probes:
            gw.send(text, log=False)
        done = time.time()  # every probe answered: the eye's next read counts them all
        story.before = loop.wait("the live figures before", lambda: loop.live(name, champ["export_path"], t, done), 90)
        loop.mark(f"live acceptance on {len(probes)} prompts of the new kind kept out of the traffic: {story.before:.3f}")
        gw.max_tokens = 8  # the day's traffic: its prompts are what the retraining learns from
        t_change = time.time()
        for text in new_kind:
            gw.send(text)
        loop.mark(f"{len(new_kind)} requests of the new kind sent and logged")
        day = dg.DailyPartitionsDefinition(start_date="2026-01-01", end_offset=1).get_last_partition_key()
        loop.cli("dagster", "asset", "materialize", "--select", "traffic", "--partition", day, location=False)
        loop.mark(f"traffic {day} read and redacted")
        # the team's switch, on once the day's traffic is read (a retraining reads the traffic there is when it runs)
        loop.cli("dagster", "sensor", "start", "retrain_on_drift_sensor")
        try:
            # the probes are of the new kind too: the live signal may report the drift from them, before the day's
            # traffic is sent, so any report since the probes is this drift's; and a lasting drift is not reported
            # twice, so one the eye made on this server's champion since its promotion (the last turn's) still stands
            loop.wait("a drift report", lambda: [r for r in inst.fetch_materializations(
                dg.AssetKey("drift_report"), limit=5).records if r.timestamp >= t_probes or open_on(r, name, champ)],
                600)
            loop.mark("drift reported")
            runs = loop.wait("the retraining to start", lambda: inst.get_runs(dg.RunsFilter(
                tags={"eagle3/retrain": ENGINE}, created_after=_utc(t_change))), 600)
        finally:
            loop.cli("dagster", "sensor", "stop", "retrain_on_drift_sensor")
        run_id = runs[0].run_id
        loop.mark(f"retrain_on_traffic started (run {run_id[:8]})")
        rec = loop.wait("the retraining", lambda: (r := inst.get_run_record_by_id(run_id)) and r.dagster_run.is_finished
                        and r, timeout_s, every_s=5)
        story.run_id, story.run_status = run_id, rec.dagster_run.status.value
        story.steps_s = _timeline(inst, run_id)
        story.production = production.current(inst, ENGINE) or {}
        loop.mark(f"retrain_on_traffic {story.run_status.lower()}: steps {json.dumps(story.steps_s)}")
        new = story.production.get("export_path", "")
        if new and new != champ["export_path"]:
            gw.max_tokens = 64
            t = time.time()
            for text in probes:
                gw.send(text, log=False)
            done = time.time()
            story.after = loop.wait("the live figures after", lambda: loop.live(name, new, t, done), 90)
            loop.mark(f"live acceptance on the same probes, {story.production['version'][:12]} serving: "
                      f"{story.after:.3f} (before {story.before:.3f})")
    finally:
        loop.stop()
        story.marks = loop.marks
    return story


def open_on(rec: dg.EventLogRecord, server: str, champ: dict) -> bool:
    """A drift report the eye made on `server` about the champion since its promotion: a drift still open."""
    m = served.meta(rec)
    return m.get("server") == server and m.get("checkpoint") == champ["version"] and rec.timestamp >= champ["when"]


def _utc(t: float):
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, tz=timezone.utc)


def stop_servers(workdir: Path, names: tuple[str, ...] = ("prod",)) -> None:
    for name in names:
        subprocess.run([*SERVER, "stop", "--dir", str(workdir / name)], check=False)


def main(home: Path, workdir: Path, workspace: Path | None = None, kind: str = "fr-es-de") -> int:
    t0 = time.time()
    try:
        story = run(home, workdir, workspace=workspace, kind=kind)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"serving-loop: {e}", file=sys.stderr)
        stop_servers(workdir)
        return 1
    stop_servers(workdir)
    print(f"==> done in {time.time() - t0:.0f} s: {story.production.get('decision', 'nothing promoted')} "
          f"{story.production.get('version', '')[:12]}; live acceptance on the new kind of traffic "
          f"{story.before:.3f} before" + (f", {story.after:.3f} after" if story.after else ""))
    print("    `eagle3-assets production`, `eagle3-assets lineage --served` (EAGLE3_SERVERS="
          f"{workdir / 'servers.yaml'}) and the UI's group `loop` show the record")
    return 0 if story.after and story.after > story.before else 1
