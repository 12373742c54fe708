"""The SSH host against a real OpenSSH server on 127.0.0.1: the same stages as the local host, through a
dropped connection, a dead control plane, a killed worker, and the ways a host can be wrong."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg

from conftest import failure_text, run_worker
from eagle3_assets.hosts import SshGpuHost

TESTS = Path(__file__).resolve().parents[1]  # tests/: the helper modules (ssh_jobs.py) the jobs import
EXTRACT = {"dtype": "float32", "batch_tokens": 256}


def ssh_host(sshd, workdir, **kw) -> SshGpuHost:
    base = dict(host="127.0.0.1", port=sshd.port, user=sshd.user, key_file=str(sshd.client_key),
                known_hosts=str(sshd.known_hosts), python=sys.executable, workdir=str(workdir), require_gpus=False,
                min_free_gb=0.1)
    return SshGpuHost(**{**base, **kw})


def job_dirs(workdir: Path, prefix: str) -> list[Path]:
    return sorted((workdir / ".eagle3" / "jobs").glob(f"{prefix}-*"))


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def started_job(workdir: Path, prefix: str, after: float, min_messages: int = 2) -> Path:
    """The run directory of a job started after `after` once it has written `min_messages` Pipes messages."""
    def find():
        for d in job_dirs(workdir, prefix):
            state, msgs = d / "state.json", d / "messages.jsonl"
            if state.exists() and state.stat().st_mtime >= after and msgs.exists() \
                    and len(msgs.read_text().splitlines()) >= min_messages:
                return d
    return wait_for(find, 120, f"a running {prefix} job")


def step_log_messages(instance, run_id: str) -> list[str]:
    return [r.user_message for r in instance.all_logs(run_id) if r.dagster_event is None]


def pipes_log_lines(rundir: Path) -> list[str]:
    out = []
    for line in (rundir / "messages.jsonl").read_text().splitlines():
        msg = json.loads(line)
        if msg["method"] == "log":
            out.append(msg["params"]["message"])
    return out


# ---------------------------------------------------------------------------------------------------------
def test_stage_over_ssh_matches_local(built, sshd):
    """The extraction stage over SSH makes the same shard (same data version, tokens, files) as locally."""
    local = built.latest("hidden_state_shards", "00000")
    local_version = built.data_version("hidden_state_shards", "00000")
    res = built.materialize("hidden_state_shards", partition="00000", host=ssh_host(sshd, built.workdir))
    assert res.success
    remote = built.latest("hidden_state_shards", "00000")
    assert built.data_version("hidden_state_shards", "00000") == local_version
    timing = {"wall_s", "tokens_per_s", "write_s", "forward_s"}
    assert {k: v for k, v in remote.items() if k not in timing} == {k: v for k, v in local.items() if k not in timing}
    messages = step_log_messages(built.instance, res.run_id)
    assert any("started the job on" in m for m in messages)
    assert any(m.startswith("extract shard-00000:") for m in messages), "the worker's progress reaches Dagster"


def test_connection_cut_mid_stage_resumes_without_loss(built, sshd):
    """sshd's session processes are killed while the worker runs: the job goes on, the resource reconnects,
    every Pipes message reaches Dagster exactly once, and both shards end up complete, once each."""
    host = ssh_host(sshd, built.workdir)
    config = {"hidden_state_shards": {"config": {**EXTRACT, "batch_tokens": 200}}}
    cuts = []

    def cutter(after):
        rundir = started_job(built.workdir, "hidden_state_shards@00000", after)
        cuts.append((rundir, sshd.cut_connections()))

    runs = []
    for key in built.instance.get_dynamic_partitions("hidden_state_shards"):
        t = threading.Thread(target=cutter, args=(time.time() - 1,)) if key == "00000" else None
        if t:
            t.start()
        res = built.materialize("hidden_state_shards", partition=key, config=config, host=host)
        assert res.success, failure_text(res)
        runs.append(res)
        if t:
            t.join()
    rundir, killed = cuts[0]
    assert killed >= 1, "the test must actually cut a live connection"
    messages = step_log_messages(built.instance, runs[0].run_id)
    assert any(m.startswith("lost the connection") for m in messages)
    assert any(m.startswith("reconnected to") for m in messages)
    worker_lines = pipes_log_lines(rundir)
    seen = [m for m in messages if m in set(worker_lines)]
    assert seen == worker_lines, "every worker log line arrives once, in order"
    assert not list(rundir.parent.glob(rundir.name + ".attempt-*")), "the job was never started twice"
    shards = sorted(p.name for p in (built.workdir / "hidden_states").iterdir() if not p.name.startswith("."))
    assert shards == ["shard-00000", "shard-00001"], shards
    for shard in shards:
        manifest = json.loads((built.workdir / "hidden_states" / shard / "manifest.json").read_text())
        parts = [f["name"] for f in manifest["files"]]
        assert len(parts) == len(set(parts))


def _control_plane(sshd, instance, workdir: Path, partition: str, batch_tokens: int) -> subprocess.Popen:
    """A separate process that launches the extraction run, as the Dagster run worker would."""
    env = {**os.environ, "DAGSTER_HOME": instance.root_directory, "T_SSH_PORT": str(sshd.port), "T_SSH_USER": sshd.user,
           "T_SSH_KEY": str(sshd.client_key), "T_SSH_KNOWN_HOSTS": str(sshd.known_hosts), "T_SSH_PYTHON": sys.executable,
           "T_SSH_WORKDIR": str(workdir), "PYTHONPATH": str(TESTS)}
    code = ("import dagster as dg, ssh_jobs, json, sys\n"
            "r = dg.execute_job(dg.reconstructable(ssh_jobs.ssh_extract_job), dg.DagsterInstance.get(),\n"
            "    run_config=json.loads(sys.argv[1]), tags={'dagster/partition': sys.argv[2]})\n"
            "sys.exit(0 if r.success else 1)\n")
    run_config = {"ops": {"hidden_state_shards": {"config": {**EXTRACT, "batch_tokens": batch_tokens}}}}
    os.environ.update({k: v for k, v in env.items() if k.startswith("T_SSH_")})  # for the retry in this process
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(run_config), partition], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _latest_run(instance, job: str) -> dg.DagsterRun:
    return instance.get_runs(dg.RunsFilter(job_name=job), limit=1)[0]


def test_dead_control_plane_then_retry_reattaches(built, sshd):
    """The process running the Dagster run is killed -9 mid-stage; run monitoring marks the run failed and
    the retry (a re-execution from failure) attaches to the job still on the host: no second copy."""
    import ssh_jobs

    instance = built.instance
    t0 = time.time() - 1
    proc = _control_plane(sshd, instance, built.workdir, "00001", batch_tokens=224)
    rundir = started_job(built.workdir, "hidden_state_shards@00001", t0)
    first = json.loads((rundir / "state.json").read_text())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run = _latest_run(instance, "ssh_extract")
    assert run.status == dg.DagsterRunStatus.STARTED  # the dead process could not say anything
    instance.report_run_failed(run, "run worker died (what run monitoring reports)")
    # the run-retries daemon carries the parent's tags over; execute_job leaves that to its caller
    retry = dg.execute_job(dg.reconstructable(ssh_jobs.ssh_extract_job), instance,
                           tags={"dagster/partition": run.tags["dagster/partition"]},
                           reexecution_options=dg.ReexecutionOptions.from_failure(run.run_id, instance))
    assert retry.success
    messages = step_log_messages(instance, retry.run_id)
    assert any("attached to the job an earlier attempt started" in m for m in messages), messages
    assert json.loads((rundir / "state.json").read_text())["worker_pid"] == first["worker_pid"]
    assert not list(rundir.parent.glob(rundir.name + ".attempt-*")), "no second copy was started"
    ev = instance.get_latest_materialization_event(dg.AssetKey("hidden_state_shards"))
    assert ev.run_id == retry.run_id and ev.asset_materialization.partition == "00001"


def test_a_reexecution_after_the_targets_weights_changed_runs_the_stage_again(sshd, tmp_path):
    """target_model has no upstream asset: the weights on the host are its input. Re-executing its run reuses the
    finished job while they are unchanged, and runs the stage again (a new data version) once they are replaced."""
    import safetensors.torch as st
    from transformers import LlamaConfig, LlamaForCausalLM

    import ssh_jobs
    from tiny_targets import smollm2_tokenizer

    target = tmp_path / "tiny"
    tok = smollm2_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(target)
    tok.save_pretrained(target)
    os.environ.update({"T_SSH_PORT": str(sshd.port), "T_SSH_USER": sshd.user, "T_SSH_KEY": str(sshd.client_key),
                       "T_SSH_KNOWN_HOSTS": str(sshd.known_hosts), "T_SSH_PYTHON": sys.executable,
                       "T_SSH_WORKDIR": str(tmp_path / "host")})
    job = dg.reconstructable(ssh_jobs.ssh_target_job)
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        def run(parent=None) -> tuple[str, list[str]]:
            res = dg.execute_job(job, instance, run_config={"ops": {"target_model": {"config": {"path": str(target)}}}},
                                 reexecution_options=dg.ReexecutionOptions(parent, step_selection=["target_model"])
                                 if parent else None)
            assert res.success
            ev = instance.get_latest_materialization_event(dg.AssetKey("target_model"))
            return ev.asset_materialization.tags["dagster/data_version"], step_log_messages(instance, res.run_id)

        first_version, first_log = run()
        assert any("started the job" in m for m in first_log)
        first_id = _latest_run(instance, "ssh_target").run_id
        same, log = run(first_id)
        assert same == first_version and any("attached to the job an earlier attempt started" in m for m in log), \
            log
        weights = target / "model.safetensors"
        tensors = st.load_file(weights)
        tensors[min(tensors)].view(-1)[0] += 1.0
        st.save_file(tensors, weights, metadata={"format": "pt"})
        changed, log = run(first_id)
        assert any("started the job" in m for m in log), log
        assert changed != first_version


def test_cancelled_run_stops_the_remote_job(built, sshd):
    """Interrupting the run (what `dagster run terminate` does to the run worker) ends the job's process
    group on the host, with the stop recorded."""
    t0 = time.time() - 1
    proc = _control_plane(sshd, built.instance, built.workdir, "00000", batch_tokens=232)
    rundir = started_job(built.workdir, "hidden_state_shards@00000", t0)
    pid = json.loads((rundir / "state.json").read_text())["worker_pid"]
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(120)
    ended = json.loads((rundir / "exit.json").read_text())
    assert ended["signal"] in (signal.SIGTERM, signal.SIGKILL)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert _latest_run(built.instance, "ssh_extract").status in (dg.DagsterRunStatus.CANCELED,
                                                                   dg.DagsterRunStatus.FAILURE)


def test_worker_killed_on_host_fails_clearly_then_rerun_succeeds(built, sshd):
    host = ssh_host(sshd, built.workdir)
    config = {"hidden_state_shards": {"config": {**EXTRACT, "batch_tokens": 240}}}
    t0 = time.time() - 1

    def kill():
        rundir = started_job(built.workdir, "hidden_state_shards@00001", t0)
        os.kill(json.loads((rundir / "state.json").read_text())["worker_pid"], signal.SIGKILL)

    t = threading.Thread(target=kill)
    t.start()
    res = built.materialize("hidden_state_shards", partition="00001", config=config, host=host, raise_on_error=False)
    t.join()
    assert not res.success
    text = failure_text(res)
    assert "killed by SIGKILL" in text and "out of memory" in text, text
    again = built.materialize("hidden_state_shards", partition="00001", config=config, host=host)
    assert again.success
    rundir = job_dirs(built.workdir, "hidden_state_shards@00001")
    assert any(p.name.endswith(".attempt-1") for p in rundir), "the killed attempt's log is kept"


def test_paths_and_arguments_pass_through_unchanged(built, sshd, tmp_path):
    """A work directory and a model path full of shell syntax reach the worker verbatim; nothing runs."""
    canary = "pwned-e3"  # would appear in the remote shell's cwd (home) or the job's (workdir) if anything ran
    nasty = f"it's a \"host\" dir $(touch {canary}) `touch {canary}`; touch {canary} & | > {canary}"
    workdir = tmp_path / nasty
    workdir.mkdir()
    target = workdir / f"model 'dir' $(touch {canary})"
    target.symlink_to(Path(built.latest("target_model")["path"]))
    places = [Path.home() / canary, workdir / canary, tmp_path / canary, Path.cwd() / canary]
    host = ssh_host(sshd, workdir)
    res = built.materialize("target_model", "prompts", host=host,
                            config={"target_model": {"config": {"path": str(target)}}})
    assert res.success, failure_text(res)
    assert built.latest("target_model")["path"] == str(target)
    assert (workdir / "prompts" / "train.parquet").exists()  # uploaded over SFTP into the odd path
    assert not any(p.exists() for p in places)
    built.materialize("target_model")  # leave the shared graph's target as it was


def test_secrets_from_env_vars_never_reach_logs(built, sshd, monkeypatch):
    monkeypatch.setenv("T_SSH_PASSPHRASE", sshd.passphrase)
    host = ssh_host(sshd, built.workdir, key_file=str(sshd.encrypted_key), key_passphrase=dg.EnvVar("T_SSH_PASSPHRASE"))
    res = dg.materialize([_probe_asset], instance=built.instance, resources={"gpu_host": host})
    assert res.success
    text = json.dumps([str(r) for r in built.instance.all_logs(res.run_id)])
    assert sshd.passphrase not in text
    for spec in (built.workdir / ".eagle3" / "jobs").rglob("job.json"):
        assert sshd.passphrase not in spec.read_text()


@dg.asset(name="host_preflight_probe")
def _probe_asset(context: dg.AssetExecutionContext, gpu_host: dg.ResourceParam[SshGpuHost]) -> dg.MaterializeResult:
    info = gpu_host.check(context, gpus=False)
    return dg.MaterializeResult(metadata={"python": info["python"]})


# ---- a wrong host: each a clear error, in seconds ------------------------------------------------------
def _fails_fast(built, host, *needles, asset="host_preflight", config=None, partition=None):
    t = time.monotonic()
    res = built.materialize(asset, host=host, raise_on_error=False, partition=partition,
                            config=config or {"host_preflight": {"config": {"gpus": False}}})
    took = time.monotonic() - t
    assert not res.success
    text = failure_text(res)
    for needle in needles:
        assert needle in text, text
    assert took < 30, f"took {took:.1f} s"
    return text


def test_wrong_host_key(built, sshd, tmp_path):
    other = tmp_path / "known_hosts"
    pub = (sshd.root / "id_stranger.pub").read_text().split()
    other.write_text(f"[127.0.0.1]:{sshd.port} {pub[0]} {pub[1]}\n")
    _fails_fast(built, ssh_host(sshd, built.workdir, known_hosts=str(other)), "does not match", "ssh-keygen -R")


def test_unknown_host_key_needs_opt_in(built, sshd, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    _fails_fast(built, ssh_host(sshd, built.workdir, known_hosts=str(empty)), "is not in", "accept_unknown_host_key")
    res = built.materialize("host_preflight", config={"host_preflight": {"config": {"gpus": False}}},
                            host=ssh_host(sshd, built.workdir, known_hosts=str(empty), accept_unknown_host_key=True))
    assert res.success
    assert any("accepting the unknown host key" in m for m in step_log_messages(built.instance, res.run_id))


def test_wrong_user_or_key(built, sshd):
    _fails_fast(built, ssh_host(sshd, built.workdir, key_file=str(sshd.stranger_key)), "refused authentication",
                "authorized_keys")
    _fails_fast(built, ssh_host(sshd, built.workdir, user="no-such-user"), "no-such-user@127.0.0.1",
                "refused authentication")
    _fails_fast(built, ssh_host(sshd, built.workdir, key_file=str(sshd.encrypted_key)), "is encrypted",
                "key_passphrase")


def test_unreachable_port(built, sshd):
    from ssh_server import _free_port

    _fails_fast(built, ssh_host(sshd, built.workdir, port=_free_port()), "cannot reach 127.0.0.1")


def test_missing_python_on_host(built, sshd):
    _fails_fast(built, ssh_host(sshd, built.workdir, python="/opt/no-such-env/bin/python3"),
                "no '/opt/no-such-env/bin/python3'", "exit 127", "Set `python`")


def test_no_gpu_when_the_stage_needs_one(built, sshd):
    _fails_fast(built, ssh_host(sshd, built.workdir, require_gpus=True), "no GPU found", "nvidia-smi",
                asset="hidden_state_shards", config={}, partition="00000")


def test_other_worker_code_installed_on_host(built, sshd, tmp_path):
    """code: installed, and the host's eagle3-assets differs from the control plane's: named, with both."""
    fake = tmp_path / "site" / "eagle3_assets"
    (fake / "worker").mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.0.1"\n')
    (fake / "worker" / "__init__.py").write_text("")
    _fails_fast(built, ssh_host(sshd, built.workdir, code="installed", env={"PYTHONPATH": str(fake.parent)}),
                "the host runs eagle3-assets 0.0.1", "install the same version there")


def test_full_disk(built, sshd, tmp_path):
    """A work directory on a 1 MB filesystem: preflight refuses; and with the floor lowered, extraction
    refuses before writing, from its own estimate of the shard's size. The host runs the installed worker code
    (`code: installed`): an upload (~0.9 MB on a tmpfs, 105 files) would fill the disk before the stage starts."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        # sizes in the unit they reach (a 1 MB disk is not "0.00 GB")
        _fails_fast(built, ssh_host(sshd, small), "MB free on the disk of", "min_free_gb")
        target = built.latest("target_model")["path"]
        (small / "conversations").mkdir()
        conv = built.workdir / "conversations" / "conversations.parquet"
        (small / "conversations" / "conversations.parquet").write_bytes(conv.read_bytes())
        host = ssh_host(sshd, small, min_free_gb=0.0, code="installed")
        res = host_stage(built, host, "extract", {"target": target, "conversations": "conversations/conversations.parquet",
                                                  "out_dir": "hidden_states", "shard": 0, "samples_per_shard": 3,
                                                  "dtype": "float32", "storage": "native"})  # ~1.7 MB
        assert re.search(r"needs ~[\d.]+ MB for [\d,]+ tokens of hidden states, but only [\d.]+ (B|kB|MB) are free", res) \
            and "bigger disk" in res, res
        # the disk fills up to the last byte (another job's output, say): the run says where and what to do, and
        # a worker whose own write fails says the disk is full, not that it crashed
        fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)  # a page at a time: not a byte is left
        os.close(fd)
        res = host_stage(built, host, "extract", {"target": target, "conversations": "conversations/conversations.parquet",
                                                  "out_dir": "hidden_states", "shard": 0, "samples_per_shard": 3,
                                                  "dtype": "float32"})
        assert "writing the job's files under" in res and "0.0 MB free" in res and "bigger disk" in res, res
        done = run_worker(small, "extract", {"target": target, "conversations": "conversations/conversations.parquet",
                                             "out_dir": "more_states", "shard": 0, "samples_per_shard": 3,
                                             "dtype": "float32"})
        assert done.returncode == 2 and "is full (0.0 MB free" in done.stderr and "bigger disk" in done.stderr, \
            done.stderr[-2000:]
        assert "crashed" not in done.stderr
    finally:
        subprocess.run(["umount", str(small)], check=False)


def host_stage(built, host, stage: str, args: dict) -> str:
    """Run one stage through the host in a throwaway asset; the failure text ('' on success)."""
    @dg.asset(name=f"stage_{stage}")
    def one(context: dg.AssetExecutionContext, gpu_host: dg.ResourceParam[SshGpuHost]):
        return gpu_host.run_stage(context, stage, args).materialize_result()

    res = dg.materialize([one], instance=built.instance, resources={"gpu_host": host}, raise_on_error=False)
    return "" if res.success else failure_text(res)
