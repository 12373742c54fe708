"""The serving eye and the rollout under faults (issue 50, case 5), against servers faked on 127.0.0.1 (a tiny
http.server in a thread): no vLLM. A bad server, a hung or leaky restart command, concurrent decisions, a bad
servers file, an unreadable gateway log."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dagster as dg
import pytest
import yaml

from eagle3_assets import cli
from eagle3_assets.common.secrets import find_secrets, secret_name
from eagle3_assets.eye import live_acceptance
from eagle3_assets.eye.servers_file import Server, ServersFile, load_servers
from eagle3_assets.loop import production
from eagle3_assets.loop import restart as restarts

TOKEN = "tok_FAKE_1234567890abcdef"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4eXoxMjM0NSJ9.c2lnbmF0dXJlMTIzNDU2"


def metrics(drafts: str = "10") -> str:
    return (f"vllm:spec_decode_num_drafts_total {drafts}\nvllm:spec_decode_num_draft_tokens_total 30\n"
            "vllm:spec_decode_num_accepted_tokens_total 15\n"
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8\n')


class Fake:
    """A server on 127.0.0.1: {path: body} answered 200 after `delay` s, anything else 404."""

    def __init__(self, routes: dict[str, str], delay: float = 0.0):
        routes_, delay_ = routes, delay

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                time.sleep(delay_)
                body = routes_.get(self.path.split("?")[0])
                try:
                    self.send_response(200 if body is not None else 404)
                    self.end_headers()
                    self.wfile.write((body or "").encode())
                except OSError:  # the reader gave up first
                    pass

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made = []

    def make(routes, delay=0.0):
        made.append(Fake(routes, delay))
        return made[-1]
    yield make
    for f in made:
        f.close()


def _status(events, name: str) -> str:
    ev = next(e for e in events if e.asset_key == dg.AssetKey(["live_acceptance", name]))
    return ev.metadata["status"].value


# ---- one bad server must not blind the eye ----------------------------------------------------------------
def test_a_nan_an_inf_or_a_slow_server_is_its_own_observation_and_blinds_no_other(fakes):
    servers = ServersFile.model_validate({"servers": [
        {"name": "good", "url": fakes({"/metrics": metrics()}).url},
        {"name": "nan", "url": fakes({"/metrics": metrics("NaN")}).url},
        {"name": "inf", "url": fakes({"/metrics": metrics("+Inf")}).url},
        {"name": "slow", "url": fakes({"/metrics": metrics()}, delay=3).url, "timeout_s": 1}]})
    _, [sensor] = live_acceptance.build(servers)
    with dg.instance_for_test() as instance:
        t0 = time.monotonic()
        got = sensor(dg.build_sensor_context(instance=instance))
        assert time.monotonic() - t0 < 3
    events = got.asset_events
    assert len(events) == 4
    assert _status(events, "good").startswith("first read") and events[0].metadata["num_drafts"].value == 10
    assert "NaN" in _status(events, "nan") and "vllm:spec_decode_num_drafts" in _status(events, "nan")
    assert "Inf" in _status(events, "inf")
    assert "unreachable" in _status(events, "slow") and "timed out" in _status(events, "slow")
    assert set(json.loads(got.cursor)) == {"good"}  # a bad read keeps no window


def test_slow_servers_together_stay_within_the_ticks_cap(fakes, monkeypatch):
    """Three servers that answer after 4 s, each allowed 25 s: the tick reads them at once and stops at its cap (the
    daemon gives a sensor 60 s), each slow server an observation saying so."""
    monkeypatch.setattr(live_acceptance, "TICK_CAP_S", 1.5, raising=False)
    servers = [Server(name=f"slow{i}", url=fakes({"/metrics": metrics()}, delay=4).url, timeout_s=25) for i in range(3)]
    t0 = time.monotonic()
    events, cursor = live_acceptance.tick(servers, None)
    assert time.monotonic() - t0 < 3.5
    assert len(events) == 3 and json.loads(cursor) == {}
    for i in range(3):  # cut by the cap, or by its read's own timeout (bounded by the cap too)
        status = _status(events, f"slow{i}")
        assert status.startswith("unreachable") and ("did not answer within" in status or "timed out" in status)


# ---- no token leaks through the rollout; a hung restart does not outlive it -------------------------------
def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # a zombie: dead, unreaped
    except FileNotFoundError:
        return True


def test_a_hung_restart_is_cut_at_the_files_timeout_its_whole_group_killed_and_its_argv_never_quoted(fakes, tmp_path):
    pidfile = tmp_path / "child.pid"
    server = Server(name="s", url=fakes({"/health": "ok"}).url, restart_timeout_s=1,
                    restart=["bash", "-c", f"sleep 300 & echo $! > {pidfile}; wait", f"--token={TOKEN}"])
    logs = []
    t0 = time.monotonic()
    why = restarts.restart(server, "/exports/new", logs.append)
    assert time.monotonic() - t0 < 10
    assert why and "1 s" in why and "bash" in why
    assert TOKEN not in why + "".join(logs) and "--token" not in why
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the restart command's child survived its timeout"


def test_a_failing_restarts_stderr_is_scrubbed(fakes):
    server = Server(name="s", url=fakes({"/health": "ok"}).url, restart=[
        "bash", "-c", f"echo 'kubectl --token={TOKEN}: token {JWT} rejected' >&2; exit 3"])
    why = restarts.restart(server, "/exports/new", lambda _: None)
    assert why.startswith("its restart command (bash) exited 3") and "rejected" in why
    assert TOKEN not in why and JWT not in why


def test_a_server_url_with_credentials_is_refused_when_the_file_loads(tmp_path):
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"servers": [{"name": "s", "url": "http://admin:s3cretPassw0rd@127.0.0.1:9"}]}))
    with pytest.raises(ValueError) as e:
        load_servers(str(path))
    assert "credentials" in str(e.value) and "s3cretPassw0rd" not in str(e.value) and "admin" not in str(e.value)


# ---- the production record agrees with the servers --------------------------------------------------------
def _exports(instance, *names: str) -> dict:
    """drafter_export records as the graph writes them (checkpoint in the input data version tag)."""
    out = {}
    for name in names:
        ckpt = (name * 12)[:12]
        instance.report_runless_asset_event(dg.AssetMaterialization(
            "drafter_export", metadata={"vllm_path": f"/exports/{name}/vllm", "source": f"/ckpt/{name}"},
            tags={"dagster/input_data_version/eagle3_drafter": ckpt}))
        out[name] = ckpt
    return out


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.delenv("EAGLE3_SERVERS", raising=False)
    (tmp_path / "dagster.yaml").write_text("")
    with dg.DagsterInstance.get() as instance:
        yield instance


def test_two_promotes_at_the_same_instant_are_serialized(home, monkeypatch):
    v = _exports(home, "a", "b")
    read = production.current

    def slow_current(*a, **kw):  # widens the window between reading production and recording the decision
        got = read(*a, **kw)
        time.sleep(1.0)
        return got
    monkeypatch.setattr(production, "current", slow_current)
    codes = []
    threads = [threading.Thread(target=lambda c=c: codes.append(cli.main(["promote", "--version", v[c]])))
               for c in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [0, 0]
    past = production.history(home, "vllm")
    assert [h["replaced"] for h in past].count("none") == 1
    assert past[0]["replaced"] == past[1]["version"]


def test_promote_rollout_with_no_or_a_bad_servers_file_records_nothing(home, monkeypatch, capsys, tmp_path):
    _exports(home, "a")
    assert cli.main(["promote", "--rollout"]) == 2
    assert "EAGLE3_SERVERS" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers: [{name: s, url: nope}]\n")
    monkeypatch.setenv("EAGLE3_SERVERS", str(bad))
    assert cli.main(["promote", "--rollout"]) == 2
    err = capsys.readouterr().err
    assert "not an http(s) URL" in err and "Traceback" not in err
    assert production.history(home, "vllm") == []


def test_after_a_failed_rollout_production_shows_what_each_server_serves(home, monkeypatch, capsys, fakes, tmp_path):
    _exports(home, "a", "b")
    servers = tmp_path / "servers.yaml"
    # s1 takes only drafter a back (so b fails and it is rolled back); s2 has no restart command
    servers.write_text(yaml.safe_dump({"servers": [
        {"name": "s1", "url": fakes({"/health": "ok"}).url, "drafter": "/exports/a/vllm",
         "restart": ["bash", "-c", "[ {drafter} = /exports/a/vllm ]"]},
        {"name": "s2", "url": fakes({"/health": "ok"}).url, "drafter": "/exports/a/vllm"}]}))
    monkeypatch.setenv("EAGLE3_SERVERS", str(servers))
    assert cli.main(["promote", "--version", "aaaaaaaa"]) == 0
    assert cli.main(["promote", "--version", "bbbbbbbb", "--rollout"]) == 1
    capsys.readouterr()
    assert cli.main(["production"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("now") and "bbbbbbbbbbbb" in out.splitlines()[0]
    s1 = next(line for line in out.splitlines() if "s1" in line)
    assert "/exports/a/vllm" in s1 and "rolled back" in s1
    assert "differ" in out and "/exports/b/vllm" in out


# ---- a bad servers file leaves the rest of the product running --------------------------------------------
def test_a_bad_servers_file_leaves_out_the_eye_alone_and_says_why(tmp_path):
    bad = tmp_path / "servers.yaml"
    bad.write_text("servers: [{name: s, url: nope}]\n")
    probe = ("from eagle3_assets.definitions import defs\nimport json\n"
             "repo = defs.get_repository_def()\n"
             "print(json.dumps({'jobs': sorted(j.name for j in repo.get_all_jobs()),"
             " 'sensors': {s.name: s.description for s in repo.sensor_defs}}))")
    env = {**os.environ, "EAGLE3_SERVERS": str(bad), "DAGSTER_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert {"prepare_data", "train_drafter", "benchmark_serving", "rollout_drafter"} <= set(got["jobs"])
    assert "benchmark_regression_sensor" in got["sensors"]
    assert "not an http(s) URL" in done.stderr  # the warning at load
    assert "not an http(s) URL" in got["sensors"]["live_acceptance_sensor"]


# ---- gateway logs and env names ---------------------------------------------------------------------------
@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv to read as a user other than root")
def test_a_gateway_log_the_user_cannot_read_is_reported_as_permission_denied():
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        root.chmod(0o755)
        (root / "locked").mkdir(mode=0o700)
        (root / "locked" / "gateway-2026-12-02.jsonl").write_text("{}\n")
        probe = ("import sys\nfrom eagle3_assets.sources.gateway_logs import expand, TrafficError\n"
                 "try:\n    expand([sys.argv[1]])\nexcept TrafficError as e:\n    print(e)\n")
        for source in (f"{root}/locked/gateway-2026-12-02.jsonl", f"{root}/locked/gateway-*.jsonl"):
            done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                   "-c", probe, source], capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "HOME": str(root)}, cwd=str(root))
            assert "permission denied" in done.stdout, done.stdout + done.stderr[-2000:]
            assert "not found" not in done.stdout and "matches no file" not in done.stdout
    finally:
        shutil.rmtree(root)


def test_a_path_to_a_token_file_is_not_a_secret_by_its_name():
    from eagle3_assets.hosts.k8s import K8sHost

    assert not secret_name("HF_HUB_TOKEN_PATH") and secret_name("HF_TOKEN") and secret_name("HF_HUB_TOKEN")
    assert find_secrets({"HF_HUB_TOKEN_PATH": "/var/run/secrets/hf/token"}) == []
    K8sHost(image="img", pvc="work", env={"HF_HUB_TOKEN_PATH": "/var/run/secrets/hf/token"})


# ---- the load a server serves, against its drafter's schedule (issue 47, item 5) --------------------------
def test_batches_beyond_the_schedules_grid_are_reported_on_the_observation():
    """A schedule measured up to 4 requests at once: a window averaging 6 running is said to be beyond it (the k
    there is the last range stretched), 3 is not; another checkpoint's schedule says nothing."""
    server = Server(name="prod", url="http://127.0.0.1:9")
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization(
            "speculation_schedule", partition="vllm", metadata={"checkpoint": "c" * 32, "grid": [1, 2, 4],
                                                                "schedule_text": "1-2: k=3, 3-1024: off"}))
        beyond = live_acceptance.beyond_schedule(instance, server, "c" * 32, {"mean_requests_running": 6.0})
        assert beyond["schedule_measured_up_to"] == 4
        assert "6 requests running at once, beyond the largest concurrency its speculation schedule measured (4)" \
            in beyond["load_beyond_schedule"]
        within = live_acceptance.beyond_schedule(instance, server, "c" * 32, {"requests_running": 3.0})
        assert within == {"schedule_measured_up_to": 4}
        assert live_acceptance.beyond_schedule(instance, server, "d" * 32, {"mean_requests_running": 6.0}) == {}


def test_a_drift_reports_load_is_the_window_the_sensor_saw_not_the_idle_minutes_its_run_waited():
    """The report runs after its replay, minutes after the sensor saw the drift, when the traffic may have stopped:
    its load line compares the sensor's window (observed_at) with the time before it."""
    from types import SimpleNamespace

    from eagle3_assets.eye import drift_report
    from eagle3_assets.eye.servers_file import asset_key

    with dg.instance_for_test() as instance:
        def read(running: float):
            instance.report_runless_asset_event(dg.AssetObservation(
                asset_key("prod"), metadata={"mean_requests_running": running, "window_s": 1.0}))
            t = time.time()
            time.sleep(1.2)
            return t

        read(1.0)
        seen = read(4.0)  # the window the sensor judged a drift in
        read(0.0)  # idle afterwards, while the report's run waits
        meta, line = drift_report.load_moved(SimpleNamespace(instance=instance), "prod", 1, now=seen + 0.1)
        assert meta == {"mean_batch_in_window": 4.0, "mean_batch_before": 1.0, "load_moved": "yes"}, line
        assert line.startswith("**Load** (moved): 4.00 requests running at once"), line
        idle, _ = drift_report.load_moved(SimpleNamespace(instance=instance), "prod", 2)
        assert idle["mean_batch_in_window"] == 0.0  # the report's own clock: the idle read


# ---- the launch file the rollout starts servers with --------------------------------------------------------
def test_a_launch_file_rewritten_after_its_schedule_was_measured_stops_the_rollout_before_any_server(
        home, monkeypatch, capsys, fakes, tmp_path):
    """The launch file beside an export is shared by whatever measured last (a sweep, a gate run again, a hand edit):
    a rollout whose {speculative_config} would start another schedule than the one recorded for the drafter (the one
    the eye and serving_benchmark hold it to) touches no server and says which schedules differ."""
    from eagle3_assets.common import spec_schedule as ss

    export = tmp_path / "exports" / "a" / "vllm"
    (export.parent / "vllm-launch").mkdir(parents=True)
    export.mkdir()
    ckpt = "a" * 12
    home.report_runless_asset_event(dg.AssetMaterialization(
        "drafter_export", metadata={"vllm_path": str(export), "source": "/ckpt/a"},
        tags={"dagster/input_data_version/eagle3_drafter": ckpt}))
    measured = [[1, 4, 3], [5, 64, 0]]
    home.report_runless_asset_event(dg.AssetMaterialization("speculation_schedule", partition="vllm", metadata={
        "checkpoint": ckpt, "schedule": dg.MetadataValue.json(measured), "schedule_text": ss.describe(measured)}))
    launch = export.parent / "vllm-launch" / "speculative_config.vllm.json"
    launch.write_text(ss.dumps(ss.vllm_config("eagle3", str(export), [(1, 1, 3), (2, 64, 0)])))  # another schedule
    marker = tmp_path / "restarted"
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump({"servers": [
        {"name": "s1", "url": fakes({"/health": "ok"}).url, "drafter": "/exports/old/vllm",
         "restart": ["bash", "-c", f"echo {{drafter}} {{speculative_config}} > {marker}"]}]}))
    monkeypatch.setenv("EAGLE3_SERVERS", str(servers))
    assert cli.main(["promote", "--version", ckpt, "--rollout"]) == 1
    err = capsys.readouterr().err
    assert "not started, no server touched" in err and "1-4: k=3, 5-64: off" in err and str(launch) in err, err
    assert not marker.exists()
    # the schedule measured again writes the file it records: the same rollout goes through, with that file
    launch.write_text(ss.dumps(ss.vllm_config("eagle3", str(export), [tuple(r) for r in measured])))
    assert cli.main(["promote", "--version", ckpt, "--rollout"]) == 0, capsys.readouterr().err
    assert marker.read_text().split() == [str(export), str(launch)]


# ---- issue 58: secrets said as separate words, a restart that backgrounds its server, a trickling server ------------
HEX_TOKEN = "5e0c9a7b" + "1f3d5b7a9c" * 3 + "e2"  # 40 hex, a kubectl service-account token's shape
PASSWORD = "Winter-Deploy-2026!"


def _every_file(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def test_a_restarts_stderr_with_secrets_as_separate_words_reaches_no_file_of_the_instance_nor_the_cli(
        home, monkeypatch, capsys, fakes, tmp_path):
    """`--token <40 hex>` and `--password <value>` (values as their own words, not --token=...) echoed by a failing
    restart: in no file under DAGSTER_HOME (event log, index.db, compute logs), not in the CLI's output, the rollout
    and production's table each scrubbed once, a multi-line error kept on its row."""
    _exports(home, "a", "b")
    monkeypatch.setenv("DEPLOY_T", HEX_TOKEN)
    monkeypatch.setenv("DEPLOY_P", PASSWORD)
    servers = tmp_path / "servers.yaml"
    servers.write_text(yaml.safe_dump({"servers": [
        {"name": "s1", "url": fakes({"/health": "ok"}).url, "drafter": "/exports/a/vllm", "restart": [
            "bash", "-c", "[ {drafter} = /exports/a/vllm ] || { echo \"+ kubectl rollout restart deploy/vllm-s1 "
            "--token $DEPLOY_T\" >&2; echo \"error: login --password $DEPLOY_P --token=$DEPLOY_T refused\" >&2; "
            "exit 3; }"]}]}))
    monkeypatch.setenv("EAGLE3_SERVERS", str(servers))
    assert cli.main(["promote", "--version", "aaaaaaaa"]) == 0
    assert cli.main(["promote", "--version", "bbbbbbbb", "--rollout"]) == 1
    assert cli.main(["production"]) == 0
    out = capsys.readouterr()
    said = out.out + out.err
    for secret in (HEX_TOKEN, PASSWORD, "Winter-Deploy"):
        assert secret not in said, said
        assert secret not in _every_file(tmp_path), f"{secret} reached a file of the instance"
    assert "--token [a secret, not shown]" in out.err and "--password [a secret, not shown]" in out.err, out.err
    assert "not shown] secret, not shown]" not in said  # scrubbed once
    s1 = [line for line in out.out.splitlines() if line.lstrip().startswith("s1 ")]
    assert len(s1) == 1 and "exited 3" in s1[0] and "refused" in s1[0], out.out  # the whole error on its row
    assert not any(line.startswith(("error:", "+ kubectl")) for line in out.out.splitlines())


def test_a_server_url_with_credentials_and_no_scheme_is_refused_without_quoting_them(tmp_path):
    """`svc:<password>@host:port`: the scheme check refuses it, naming neither the password in its message (the daemon
    log, the sensors' stored skip reasons and descriptions), nor anywhere in the instance."""
    bad = tmp_path / "servers.yaml"
    bad.write_text(yaml.safe_dump({"servers": [{"name": "s", "url": f"svc:{PASSWORD}@127.0.0.1:19541"}]}))
    with pytest.raises(ValueError) as e:
        load_servers(str(bad))
    assert "not an http(s) URL" in str(e.value) and PASSWORD not in str(e.value), str(e.value)
    probe = ("from eagle3_assets.definitions import defs\nimport json\nrepo = defs.get_repository_def()\n"
             "print(json.dumps({s.name: s.description for s in repo.sensor_defs}))")
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "EAGLE3_SERVERS": str(bad), "DAGSTER_HOME": str(home)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not an http(s) URL" in json.loads(done.stdout.splitlines()[-1])["live_acceptance_sensor"]
    assert PASSWORD not in done.stdout + done.stderr + _every_file(home)


@pytest.mark.parametrize("env, refused", [
    ({"API_KEY_FILE": "hunter2-Deploy!"}, True),  # a path's name, a password's value
    ({"HF_TOKEN_PATH": "my token"}, True),
    ({"GOOGLE_APPLICATION_CREDENTIALS": "/secrets/sa.json"}, False),  # the standard name of a key file's path
    ({"API_KEY_FILE": "/run/secrets/api_key"}, False),
    ({"SSH_KEY_FILE": "~/.ssh/id_ed25519"}, False),
    ({"TOKEN_FILE": "token.txt"}, False),
])
def test_a_path_name_lets_only_a_path_through(env, refused):
    from eagle3_assets.hosts.k8s import K8sHost

    assert bool(find_secrets(env)) == refused, find_secrets(env)
    if refused:
        with pytest.raises(ValueError) as e:
            K8sHost(image="img", pvc="work", env=env)
        assert next(iter(env.values())) not in str(e.value)
    else:
        K8sHost(image="img", pvc="work", env=env)


def test_a_restart_that_starts_its_server_in_the_background_is_done_when_it_exits(fakes, tmp_path):
    """`nohup vllm serve ... &` with its output not redirected: the server it leaves holds the command's output, and
    the restart is over when the command exits, not when that output ends. The server it detached is left running."""
    pidfile = tmp_path / "server.pid"
    server = Server(name="s", url=fakes({"/health": "ok"}).url, restart_timeout_s=5,
                    restart=["bash", "-c", f"nohup sleep 300 & echo $! > {pidfile}; echo started"])
    logs = []
    t0 = time.monotonic()
    why = restarts.restart(server, "/exports/new", logs.append)
    try:
        assert why is None, why
        assert time.monotonic() - t0 < 5
        assert not _gone(int(pidfile.read_text())), "the server the restart started was killed"
        assert any("left processes running" in line and "left alone" in line for line in logs), logs
    finally:
        os.kill(int(pidfile.read_text()), 9)  # the one process this test started


def test_a_server_whose_metrics_trickle_leaves_no_reader_behind(monkeypatch):
    """/metrics sent a byte every 0.3 s: the read ends at the server's timeout (a socket timeout alone bounds each
    byte, not the answer), and no reader thread outlives the tick."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b"#")
            except OSError:
                break
            time.sleep(0.3)
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    monkeypatch.setattr(live_acceptance, "TICK_CAP_S", 10.0, raising=False)
    server = Server(name="trickle", url=f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=2)
    try:
        events, _ = live_acceptance.tick([server], None)
        assert "still coming after 2 s" in _status(events, "trickle"), _status(events, "trickle")
        time.sleep(1.0)
        assert not [t for t in threading.enumerate() if t.name.startswith("live_acceptance") and t.is_alive()]
    finally:
        stop.set()
        listener.close()
