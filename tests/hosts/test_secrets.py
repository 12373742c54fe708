"""Secrets, wherever a user puts them: refused in the run config, never quoted by an error, never on a command
line, never in a file wider than the owner's; a wrong key file or passphrase is a config error, not a dead host."""

import json
import os
import secrets
import stat
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
from test_ssh_host import ssh_host

from conftest import failure_text
from eagle3_assets.hosts import LocalGpuHost
from eagle3_assets.hosts.ssh import CONFIG_ERROR, UNREACHABLE

PREFLIGHT = {"host_preflight": {"config": {"gpus": False}}}


def _failure(result) -> dg.DagsterEvent:
    return next(ev for ev in result.all_events if ev.is_step_failure)


def _instance_text(instance, run_id: str) -> str:
    """What the run left for users to read: its event log, and every compute log file of the instance."""
    text = json.dumps([str(r) for r in instance.all_logs(run_id)])
    root = Path(instance.root_directory)
    for p in root.rglob("*"):
        if p.is_file() and p.suffix in (".out", ".err", ".complete", ".log", ".txt", ""):
            text += p.read_text(errors="replace")
    return text


def _wider_than_owner(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and stat.S_IMODE(p.stat().st_mode) & 0o077]


class CommandLines:
    """Every process's command line on this machine, sampled while a run goes on (a stage's worker lives seconds)."""

    def __init__(self):
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.is_set():
            for d in Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        self.seen.add((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                    except OSError:  # ended meanwhile
                        pass
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ---- key files: config errors, never the key's text ----------------------------------------------------
def _config_failure(built, host, *needles):
    res = built.materialize("host_preflight", host=host, raise_on_error=False, config=PREFLIGHT)
    assert not res.success
    text = failure_text(res)
    for needle in needles:
        assert needle in text, text
    meta = {k: v.value for k, v in _failure(res).step_failure_data.user_failure_data.metadata.items()}
    assert meta[UNREACHABLE] is False and meta[CONFIG_ERROR] is True, "a config error is not a dead host (failover)"
    assert _failure(res).step_failure_data.user_failure_data is not None
    return res, text


def test_key_text_where_the_key_file_path_goes_is_refused_and_never_shown(built, sshd):
    key_text = sshd.client_key.read_text()
    body = key_text.splitlines()[1]  # a line of the key's base64
    res, text = _config_failure(built, ssh_host(sshd, built.workdir, key_file=key_text), "looks like key text",
                                "not a path", "ssh-add")
    assert body not in text
    assert body not in _instance_text(built.instance, res.run_id), "the key reached the event log or compute logs"


def test_a_missing_key_file_names_the_path_and_is_not_a_dead_host(built, sshd, tmp_path):
    missing = tmp_path / "no-such-key"
    _config_failure(built, ssh_host(sshd, built.workdir, key_file=str(missing)), f"key_file {missing}",
                    "No such file", "set key_file")


def test_a_wrong_passphrase_is_a_config_error(built, sshd):
    _config_failure(built, ssh_host(sshd, built.workdir, key_file=str(sshd.encrypted_key), key_passphrase="wrong"),
                    "could not be opened with key_passphrase", "passphrase is wrong")


def test_an_unknown_host_key_is_a_config_error(built, sshd, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    _config_failure(built, ssh_host(sshd, built.workdir, known_hosts=str(empty)), "is not in",
                    "accept_unknown_host_key")


# ---- the run config: secrets refused by name and by value, the value never repeated ------------------------
HF_TOKEN = "hf_" + "".join(secrets.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
                           for _ in range(34))
RANDOM_TOKEN = secrets.token_hex(4) + "Q" + secrets.token_urlsafe(30).replace("-", "x").replace("_", "y")


@pytest.mark.parametrize("where, config, needle", [
    ("a token under a secret's name", {"env": {"HF_AUTH": "plain-looking-value-123"}}, "env.HF_AUTH"),
    ("a Hugging Face token under any name", {"env": {"DOWNLOAD_OPTS": HF_TOKEN}}, "Hugging Face token"),
    ("a long random token under any name", {"env": {"WANDB_KEY": RANDOM_TOKEN}}, "env.WANDB_KEY"),
    ("a random token in a plain setting", {"engine_python": RANDOM_TOKEN}, "engine_python: looks like a long random"),
])
def test_a_secret_in_the_run_config_is_refused_without_repeating_it(built, where, config, needle):
    res = built.materialize("synthetic_prompts", raise_on_error=False,
                            config={"synthetic_prompts": {"config": {"count": 0, **config}}})
    assert not res.success, where
    text = failure_text(res)
    assert needle in text and "not shown" in text and "dg.EnvVar" in text, text
    for value in (HF_TOKEN, RANDOM_TOKEN, "plain-looking-value-123"):
        assert value not in text
        # the run's config holds what the user typed; nothing the run itself wrote repeats it
        assert value not in json.dumps([r.user_message for r in built.instance.all_logs(res.run_id)])


def test_ordinary_settings_are_not_taken_for_secrets():
    from eagle3_assets.stages.prepare_target import PrepareTargetSettings
    from eagle3_assets.stages.serve_bench import ServeBenchSettings

    ServeBenchSettings(env={"TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "2"},
                       extra_args=["--attention-backend", "CPU_MLA"])
    for path in ("/models/moonshotai/Kimi-K2-Instruct-0905-FP8", "nvidia/Llama-3.3-70B-Instruct-Eagle3-ShareGPT-v2",
                 "/data/" + "0123456789abcdef" * 4, "HuggingFaceH4/ultrachat_200k"):
        PrepareTargetSettings(path=path)


# ---- arguments and the host's own secrets: never on a command line, never in a file others can read --------
@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_stage_arguments_and_host_secrets_stay_off_command_lines_and_shared_files(built, sshd, tmp_path, kind):
    """A secret given the right way (the host's `env`) reaches the worker; the stage's arguments reach it in an
    owner-only file: neither is on any process's command line while the run goes on, nor in a file wider than 600."""
    secret = "hf_" + secrets.token_hex(20)
    marker = f"args-marker-{secrets.token_hex(6)}"  # a stage argument: the target's path, through a symlink
    target = tmp_path / marker
    target.symlink_to(Path(built.latest("target_model")["path"]))
    workdir = tmp_path / "work"
    workdir.mkdir()
    host = ssh_host(sshd, workdir, env={"HF_TOKEN": secret}) if kind == "ssh" else \
        LocalGpuHost(workdir=str(workdir), python=sys.executable, env={"HF_TOKEN": secret})
    with CommandLines() as seen:
        res = built.materialize("target_model", host=host, config={"target_model": {"config": {"path": str(target)}}})
    assert res.success, failure_text(res)
    workers = [c for c in seen.seen if "eagle3_assets.worker prepare_target" in c]
    assert workers and all("--args-file" in c for c in workers), "the sampler saw the worker, reading its file"
    assert not [c for c in seen.seen if marker in c or secret in c]
    wide = _wider_than_owner(workdir / ".eagle3") if (workdir / ".eagle3").exists() else []
    assert not [p for p in wide if secret in p.read_text(errors="replace")]
    if kind == "ssh":
        (rundir,) = (workdir / ".eagle3" / "jobs").glob("target_model-*")
        for name in ("job.json", "args.json", "state.json", "exit.json"):
            assert stat.S_IMODE((rundir / name).stat().st_mode) == 0o600, name
        job = json.loads((rundir / "job.json").read_text())
        assert marker in (rundir / "args.json").read_text() and marker not in " ".join(job["argv"])
        assert secret not in (rundir / "job.json").read_text()
    assert secret not in _instance_text(built.instance, res.run_id)
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("prepare_target-args-*")), "the local args file is removed"
    built.materialize("target_model")  # leave the shared graph's target as it was


# ---- messages: a flag's value as its own word, a URL without a scheme, scrubbing twice ---------------------------
@pytest.mark.parametrize("text, secret", [
    ("+ kubectl rollout restart deploy/vllm-s1 --token 5e0c9a7b1f3d5b7a9c1f3d5b7a9c1f3d5b7a9ce2", "5e0c9a7b1f3d"),
    ("login --password Winter-Deploy-2026! refused", "Winter-Deploy"),
    ("curl -u x --api-key 'two words' https://h", "two words"),
    ("PGPASSWORD=s3cr3t psql -h db", "s3cr3t"),
    ("auth token: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b rejected", "9f86d081884c"),
    ("'svc:hunter2-Deploy@127.0.0.1:19541' is not an http(s) URL", "hunter2-Deploy"),
    ("http://admin:pw-1234@10.0.0.5:8000/metrics", "pw-1234"),
])
def test_scrub_takes_a_secret_said_in_each_way_and_scrubbing_twice_changes_nothing(text, secret):
    from eagle3_assets.common.secrets import scrub

    once = scrub(text)
    assert secret not in once and "not shown]" in once, once
    assert scrub(once) == once


@pytest.mark.parametrize("text", [
    "vllm serve /m --max-num-batched-tokens 8192 --tokenizer /m --no-auth --port 8000",
    "version 4.10.2.7 of the key-value cache; token ids 128000-128255",
    "--speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}'",
])
def test_scrub_leaves_what_is_no_secret(text):
    from eagle3_assets.common.secrets import scrub

    assert scrub(text) == text
