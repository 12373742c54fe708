"""The reliability issue's host cases: a re-execution after an input changed runs afresh (SSH), a dead control
plane leaves no worker behind and a retry never runs beside one (local host), worker code changed on the host
is restored before it runs, the host's `env` never reaches a command line; and the prompt and shard inputs
that used to end in a raw exception or wrong data."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from test_ssh_host import _probe_asset, ssh_host, step_log_messages, wait_for

import ssh_jobs
from conftest import failure_text, hidden_states
from eagle3_assets.assets.vocab import vocab_mapping
from eagle3_assets.hosts import GpuHost, LocalGpuHost
from eagle3_assets.hosts.preflight import local_files, local_fingerprint

CONV = "conversations/conversations.parquet"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stage(instance, host, stage: str, args: dict):
    """One stage through `host` in a throwaway asset: the run's result (not raised)."""
    @dg.asset(name=f"one_{stage}")
    def one(context: dg.AssetExecutionContext, gpu_host: GpuHost):
        return gpu_host.run_stage(context, stage, args).materialize_result()

    return dg.materialize([one], instance=instance, resources={"gpu_host": host}, raise_on_error=False)


def _extract_args(built, **kw) -> dict:
    return {"target": built.latest("target_model")["path"], "conversations": str(built.workdir / CONV),
            "out_dir": "hidden_states", "shard": 0, "samples_per_shard": 3, "dtype": "float32", "batch_tokens": 256,
            **kw}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _holder(work: Path, name: str) -> dict | None:
    for lock in (work / ".eagle3" / "locks").glob(f"{name}-*.lock"):
        try:
            return json.loads(lock.read_text())
        except ValueError:  # not written yet
            pass
    return None


# ---- 2: re-executing a run after an input changed runs a fresh job on the SSH host ------------------------------

class _File(dg.Config):
    file: str


@dg.asset(name="conversations")
def _conversations(context: dg.AssetExecutionContext, config: _File, gpu_host: GpuHost) -> dg.MaterializeResult:
    """Stands in for the regeneration: puts a conversations file on the host, versioned by its content."""
    gpu_host.put_file(config.file, CONV)
    return dg.MaterializeResult(data_version=dg.DataVersion(_sha(Path(config.file))[:32]))


@dg.asset(name="target_model")
def _target(config: _File) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"path": config.file})


def vocab_over_ssh_job() -> dg.JobDefinition:
    job = dg.define_asset_job("vocab_over_ssh", selection=["vocab_mapping"], executor_def=dg.in_process_executor)
    defs = dg.Definitions(assets=[vocab_mapping, _conversations, _target], jobs=[job],
                          resources={"gpu_host": ssh_jobs.ssh_host_from_env()})
    return defs.resolve_job_def("vocab_over_ssh")


def test_reexecution_after_an_input_changed_runs_a_fresh_job(built, sshd, tmp_path, monkeypatch):
    """vocab_mapping over SSH, then conversations changes, then the run is re-executed: the finished job on the
    host is not reused, a fresh one computes the new vocab, and its version is recorded against the new
    input. Re-executed again with nothing changed, the finished job is reused."""
    work = tmp_path / "work"
    work.mkdir()
    for k, v in {"T_SSH_PORT": sshd.port, "T_SSH_USER": sshd.user, "T_SSH_KEY": sshd.client_key,
                 "T_SSH_KNOWN_HOSTS": sshd.known_hosts, "T_SSH_PYTHON": sys.executable, "T_SSH_WORKDIR": work}.items():
        monkeypatch.setenv(k, str(v))
    fewer = tmp_path / "fewer.parquet"
    pq.write_table(pq.read_table(built.workdir / CONV).slice(0, 2), fewer)
    run_config = {"ops": {"vocab_mapping": {"config": {"draft_vocab_size": 64}}}}
    job = dg.reconstructable(vocab_over_ssh_job)
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        def upstream(conversations: Path) -> str:
            cfg = {"conversations": {"config": {"file": str(conversations)}},
                   "target_model": {"config": {"file": built.latest("target_model")["path"]}}}
            dg.materialize([_conversations, _target], instance=instance, resources={"gpu_host": ssh_host(sshd, work)},
                           run_config={"ops": cfg})
            return _sha(conversations)[:32]

        def vocab_version() -> tuple[str, str]:
            ev = instance.get_latest_materialization_event(dg.AssetKey("vocab_mapping")).asset_materialization
            return ev.tags["dagster/data_version"], ev.tags["dagster/input_data_version/conversations"]

        upstream(built.workdir / CONV)
        first = dg.execute_job(job, instance, run_config=run_config)
        assert first.success
        v1, _ = vocab_version()

        changed = upstream(fewer)
        again = dg.execute_job(job, instance, run_config=run_config, reexecution_options=dg.ReexecutionOptions(
            parent_run_id=first.run_id, step_selection=["vocab_mapping"]))
        assert again.success
        messages = step_log_messages(instance, again.run_id)
        assert any(m.startswith("started the job on") for m in messages), messages
        assert not any("attached to the job" in m for m in messages), messages
        v2, recorded_input = vocab_version()
        assert v2 != v1 and v2 == _sha(work / "vocab" / "vocab_mapping.safetensors")[:32]
        assert recorded_input == changed

        same = dg.execute_job(job, instance, run_config=run_config, reexecution_options=dg.ReexecutionOptions(
            parent_run_id=again.run_id, step_selection=["vocab_mapping"]))
        assert same.success
        assert any("attached to the job an earlier attempt started" in m for m in step_log_messages(instance, same.run_id))
        assert vocab_version() == (v2, changed)


def _jobs(*words: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "eagle3_assets.worker.jobs", *words], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_running_job_on_inputs_that_changed_is_refused_not_attached(tmp_path):
    """A job still runs on the host when its inputs change: a launch for the new inputs neither attaches to it
    (it would record the old result against the new inputs) nor starts a second one beside it."""
    rundir = tmp_path / "jobs" / "vocab_mapping-abc"

    def spec(inputs: str) -> str:
        path = tmp_path / f"spec-{inputs}.json"
        path.write_text(json.dumps({"argv": [sys.executable, "-c", "import time; time.sleep(120)"], "env": {},
                                    "attach_key": "run-1", "inputs": inputs}))
        return str(path)

    started = _jobs("launch", str(rundir), spec("old"))
    try:
        assert started["action"] == "started"
        assert _jobs("launch", str(rundir), spec("old"))["action"] == "attached"  # a retry, same inputs
        refused = _jobs("launch", str(rundir), spec("new"))
        assert refused["action"] == "refused" and f"pid {started['worker_pid']}" in refused["reason"]
        assert "jobs stop" in refused["reason"] and not list(tmp_path.glob("jobs/*.attempt-*"))
    finally:
        _jobs("stop", str(rundir), "5")


# ---- 4: a dead control plane leaves no local worker; a second worker for one output is refused -----------------

_CONTROL_PLANE = """
import dagster as dg, json, sys
from eagle3_assets.hosts import GpuHost, LocalGpuHost

@dg.asset(name="one_extract")
def one(context: dg.AssetExecutionContext, gpu_host: GpuHost):
    return gpu_host.run_stage(context, "extract", json.loads(sys.argv[2])).materialize_result()

dg.materialize([one], resources={"gpu_host": LocalGpuHost(workdir=sys.argv[1])})
"""


def test_dead_local_control_plane_takes_its_worker_along(built, tmp_path):
    """The process running a local stage is killed -9 with its process group while the worker is busy: the
    worker (in a session of its own, out of reach of that kill) stops too, and the retry completes the shard."""
    work = tmp_path / "work"
    args = _extract_args(built)
    cp = subprocess.Popen([sys.executable, "-c", _CONTROL_PLANE, str(work), json.dumps(args)], start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        holder = wait_for(lambda: _holder(work, "shard-00000"), 120, "the worker to take its output's lock")
        pid = holder["pid"]
        assert _alive(pid) and int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == cp.pid
        assert os.getsid(pid) != os.getsid(cp.pid)  # the kill below cannot reach it by itself
    finally:
        os.killpg(cp.pid, signal.SIGKILL)
        cp.wait()
    res = _stage(built.instance, LocalGpuHost(workdir=str(work)), "extract", args)  # the retry, straight away
    assert res.success, failure_text(res)
    wait_for(lambda: not _alive(pid), 30, f"worker {pid} to end with its control plane")
    shard = work / "hidden_states" / "shard-00000"
    manifest = json.loads((shard / "manifest.json").read_text())
    for f in manifest["files"]:
        assert _sha(shard / f["name"]) == f["sha256"]
    assert not list((work / "hidden_states").glob(".tmp-*")), "nothing half-written is left"


def test_a_second_worker_for_the_same_output_waits_then_is_refused_naming_the_first(built, tmp_path):
    """A worker started by hand is busy on shard 0 (held stopped with SIGSTOP, so it stays busy); a run for
    the same shard waits for it, then refuses naming its pid, without touching its files; the first finishes."""
    work = tmp_path / "work"
    args = _extract_args(built)
    first = subprocess.Popen([sys.executable, "-m", "eagle3_assets.worker", "extract", "--workdir", str(work),
                              "--args", json.dumps(args)], env={**os.environ, "EAGLE3_NO_BAR": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        holder = wait_for(lambda: _holder(work, "shard-00000"), 120, "the first worker to take the lock")
        assert holder["pid"] == first.pid
        os.kill(first.pid, signal.SIGSTOP)
        before = sorted(p.name for p in (work / "hidden_states").iterdir()) if (work / "hidden_states").exists() else []
        t = time.monotonic()
        res = _stage(built.instance, LocalGpuHost(workdir=str(work), env={"EAGLE3_OUTPUT_LOCK_WAIT_S": "2"}),
                     "extract", args)
        assert not res.success
        text = failure_text(res)
        assert f"another extract worker (pid {first.pid}" in text and "shard-00000" in text, text
        assert f"kill {first.pid}" in text and time.monotonic() - t >= 2
        now = sorted(p.name for p in (work / "hidden_states").iterdir()) if (work / "hidden_states").exists() else []
        assert now == before, "the refused worker touched nothing"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert (work / "hidden_states" / "shard-00000" / "manifest.json").exists()


# ---- 7: worker code changed on the host is restored before anything runs from it --------------------------------

def test_uploaded_worker_code_changed_on_the_host_is_restored(built, sshd, tmp_path):
    work = tmp_path / "work"
    host = ssh_host(sshd, work)
    assert dg.materialize([_probe_asset], instance=built.instance, resources={"gpu_host": host}).success  # uploads
    code = work / ".eagle3" / "code" / local_fingerprint() / "eagle3_assets"
    main = code / "worker" / "__main__.py"
    main.write_text('raise SystemExit("the edited worker code ran")\n' + main.read_text())
    (code / "worker" / "data" / "vocab.py").unlink()
    (code / "stages" / "vocab.py").write_text("raise SystemExit('the edited contract ran')\n")  # contracts ship too
    (code / "worker" / "extra_hook.py").write_text("print('not ours')\n")

    res = _stage(built.instance, host, "vocab", {"target": built.latest("target_model")["path"],
                                                 "conversations": str(built.workdir / CONV), "out": "vocab/v.safetensors",
                                                 "draft_vocab_size": 64})
    assert res.success, failure_text(res)
    restored = [m for m in step_log_messages(built.instance, res.run_id) if "changed on the host" in m]
    assert restored and all(w in restored[0] for w in ("worker/__main__.py", "worker/data/vocab.py", "stages/vocab.py",
                                                       "worker/extra_hook.py"))
    assert {rel: _sha(code / rel) for rel in local_files()} == local_files()
    assert not (code / "worker" / "extra_hook.py").exists()

    again = _stage(built.instance, host, "vocab", {"target": built.latest("target_model")["path"],
                                                   "conversations": str(built.workdir / CONV),
                                                   "out": "vocab/v.safetensors", "draft_vocab_size": 64})
    assert again.success and not any("changed on the host" in m for m in step_log_messages(built.instance, again.run_id))


# ---- 8: the host's env reaches the worker, never a command line -------------------------------------------------

RECORDER = """#!/bin/sh
# sshd runs this instead of each command (ForceCommand): the command line the login shell would get, logged
printf '%s\\n' "$SSH_ORIGINAL_COMMAND" >> "{log}"
case "$SSH_ORIGINAL_COMMAND" in internal-sftp|*sftp-server*) exec /usr/lib/openssh/sftp-server ;; esac
exec "${{SHELL:-/bin/sh}}" -c "$SSH_ORIGINAL_COMMAND"
"""

SITECUSTOMIZE = """import hashlib, os
token = os.environ.get("E3_TEST_TOKEN")
if token:  # proof that the environment arrived, without writing the value itself
    with open(os.path.join(os.path.dirname(__file__), f"seen-{os.getpid()}"), "w") as f:
        f.write(hashlib.sha256(token.encode()).hexdigest())
"""


@pytest.fixture
def recording_sshd(tmp_path):
    """A second real sshd whose every command is written to a log before it runs."""
    from ssh_server import SshServer

    if not Path("/usr/lib/openssh/sftp-server").exists():
        pytest.skip("needs OpenSSH's sftp-server at /usr/lib/openssh/sftp-server")
    server = SshServer(tmp_path / "sshd")
    recorder = server.root / "record.sh"
    server.commands = server.root / "commands.log"
    recorder.write_text(RECORDER.format(log=server.commands))
    recorder.chmod(0o755)
    server.config.write_text(server.config.read_text() + f"ForceCommand {recorder}\n")
    server.start()
    yield server
    server.stop()


class _CmdlineWatch(threading.Thread):
    """Reads every process's command line on this machine, over and over, until stopped."""

    def __init__(self, needle: bytes):
        super().__init__(daemon=True)
        self.needle, self.scans, self.hits, self.done = needle, 0, [], threading.Event()

    def run(self):
        while not self.done.is_set():
            for p in Path("/proc").iterdir():
                if p.name.isdigit():
                    try:
                        cmd = (p / "cmdline").read_bytes()
                    except OSError:
                        continue
                    if self.needle in cmd:
                        self.hits.append(cmd)
            self.scans += 1


def test_env_secrets_never_reach_a_command_line_or_a_log(built, recording_sshd, tmp_path):
    secret = f"e3-secret-{uuid.uuid4().hex}"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    work = tmp_path / "work"
    host = ssh_host(recording_sshd, work, env={"E3_TEST_TOKEN": secret, "PYTHONPATH": str(site)})
    watch = _CmdlineWatch(secret.encode())
    watch.start()
    try:
        pre = dg.materialize([_probe_asset], instance=built.instance, resources={"gpu_host": host})
        res = _stage(built.instance, host, "vocab", {"target": built.latest("target_model")["path"],
                                                     "conversations": str(built.workdir / CONV),
                                                     "out": "vocab/v.safetensors", "draft_vocab_size": 64})
    finally:
        watch.done.set()
        watch.join()
    assert pre.success and res.success, failure_text(res)
    commands = recording_sshd.commands.read_text()
    assert "def probe(" in commands and "eagle3_assets.worker.jobs launch" in commands  # the recorder saw them
    assert secret not in commands
    assert watch.scans > 10 and watch.hits == []
    seen = {p.read_text() for p in site.glob("seen-*")}
    assert seen == {hashlib.sha256(secret.encode()).hexdigest()} and len(list(site.glob("seen-*"))) >= 2, \
        "the probe and the worker both got the variable"
    for run in (pre, res):
        assert secret not in json.dumps([str(r) for r in built.instance.all_logs(run.run_id)])
    on_host = [p for p in work.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert on_host == [], on_host  # job.json keeps only the names once the job has started
    assert "E3_TEST_TOKEN" in json.loads(next((work / ".eagle3" / "jobs").glob("*/job.json")).read_text())["env"]
    assert secret not in recording_sshd.log.read_text()


# ---- 11: bad inputs that used to end in a raw exception or wrong data -------------------------------------------

def _prompts(graph, sources, **extra):
    cfg = {"prompts": {"config": {"sources": [str(s) for s in sources], "include_humaneval": False,
                                  "eval_fraction": 0.0, **extra}}}
    return graph.materialize("prompts", config=cfg, raise_on_error=False)


def test_bad_bytes_in_a_prompt_file_name_the_line_and_can_be_skipped(graph, tmp_path):
    f = tmp_path / "latin1.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    f.write_bytes(f"{good}\n".encode() + '{"prompt": "café"}\n'.encode("latin-1") + f"{good.replace('2 + 2', '5')}\n".encode())
    res = _prompts(graph, [f])
    assert not res.success
    assert f"{f}, line 2: not UTF-8 text" in failure_text(res) and "on_bad_record='skip'" in failure_text(res)
    try:
        ok = _prompts(graph, [f], on_bad_record="skip")
        assert ok.success, failure_text(ok)
        assert graph.latest("prompts")["bad_records_skipped"] == 1 and graph.latest("prompts")["train_conversations"] == 2
    finally:
        graph.materialize("prompts")  # the fixture's prompts again


def test_content_part_lists_are_joined_to_text_and_other_parts_refused(graph, tmp_path):
    f = tmp_path / "openai.jsonl"
    parts = [{"type": "text", "text": "Name a prime"}, {"type": "text", "text": "above ten."}]
    image = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    f.write_text(json.dumps({"messages": [{"role": "user", "content": parts}]}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": image}]}) + "\n")
    res = _prompts(graph, [f])
    assert not res.success
    assert f"{f}, line 2: a user turn holds a content part of type 'image_url'" in failure_text(res)
    try:
        ok = _prompts(graph, [f], on_bad_record="skip")
        assert ok.success, failure_text(ok)
        rows = pq.read_table(graph.workdir / "prompts" / "train.parquet").to_pylist()
        assert [r["messages"][0]["content"] for r in rows] == ["Name a prime\nabove ten."]  # not "[{'type': ..."
    finally:
        graph.materialize("prompts")


@pytest.mark.skipif(__import__("importlib").util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_a_url_whose_fsspec_backend_is_missing_names_the_package(graph):
    res = _prompts(graph, ["s3://some-bucket/chats.jsonl"])
    assert not res.success
    text = failure_text(res)
    assert "'s3://some-bucket/chats.jsonl'" in text and "s3fs" in text and "pip install" in text


def _samples(shard: Path) -> dict[str, dict[str, torch.Tensor]]:
    parts, out = {}, {}
    for row in pq.read_table(shard / "index.parquet").to_pylist():
        t = parts.setdefault(row["part"], hidden_states(load_file(str(shard / row["part"]))))
        out[row["id"]] = {k: v[row["offset"]: row["offset"] + row["length"]] for k, v in t.items()}
    return out


def test_a_sample_longer_than_a_part_buffer_gets_a_part_of_its_own(built, tmp_path):
    """Parts of 1 byte and batches of 16 tokens: every sample is longer than a part buffer. The shard holds the
    same states as the fixture's, one sample per part."""
    work = tmp_path / "work"
    res = _stage(built.instance, LocalGpuHost(workdir=str(work)), "extract",
                 _extract_args(built, part_bytes=1, batch_tokens=16))
    assert res.success, failure_text(res)
    small, ref = _samples(work / "hidden_states" / "shard-00000"), _samples(built.workdir / "hidden_states" / "shard-00000")
    assert small.keys() == ref.keys()
    assert len(json.loads((work / "hidden_states" / "shard-00000" / "manifest.json").read_text())["files"]) == len(ref)
    for sid, t in ref.items():
        assert torch.equal(small[sid]["input_ids"], t["input_ids"]) and torch.equal(small[sid]["loss_mask"], t["loss_mask"])
        for k in ("aux", "final"):
            # other batch shapes, other float32 rounding: equal to within float32 noise (and, in fp8, the step
            # that noise can flip a value to)
            assert ((small[sid][k] - t[k]).abs() <= 2.02 * t[f"{k}_step"] + 1e-3 + 1e-3 * t[k].abs()).all(), k
