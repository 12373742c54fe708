"""The SSH host: stages run on a remote GPU machine reached with paramiko, reporting through Dagster Pipes.

Each stage runs as a detached job on the host (`worker/jobs.py`): its own session and process group, the
Pipes context in its environment, its Pipes messages appended to a file in its run directory. This side
tails that file over SFTP from a byte offset, so a dropped connection costs nothing: reconnect, resume at
the offset, no message lost or repeated. A retry of the same run finds the job still running (or finished
well) and attaches instead of starting a second copy.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from ..common.worker_env import NO_BAR_ENV
from ..stages import contract
from . import inputs, preflight
from .base import GpuHost, StageRun, describe_exit, stage_outcome
from .ssh_connection import Connection, EnvNameError, RemoteCommandError, SshError, SshTarget, is_link_error

JOBS_MODULE = "eagle3_assets.worker.jobs"
ARGS_FILE = "args.json"  # jobs.py's ARGS: the name it replaces with the file's path in the job's run directory
UNREACHABLE = "host_unreachable"  # step-failure metadata: the host did not answer (not: the stage failed there)
CONFIG_ERROR = "host_config_error"  # step-failure metadata: the host's settings are wrong; fix them, then run again


class _RemoteMessages(dg.PipesMessageReader):
    """Pipes reader for a messages file on the host: it tells the worker where to write; the host's
    follow loop reads the file and feeds the handler."""

    def __init__(self, path: str):
        self.path = path
        self.handler = None

    @contextmanager
    def read_messages(self, handler) -> Iterator[dict]:
        self.handler = handler
        yield {"path": self.path}

    @property
    def expected_writer_count(self) -> int:  # one worker writes (rank 0 relays data-parallel ranks)
        return 1

    def no_messages_debug_text(self) -> str:
        return f"Pipes messages are read over SFTP from {self.path} on the host."


class SshGpuHost(GpuHost):
    """A GPU host over SSH. Secrets (key_passphrase, password) belong in environment variables: give them
    as dg.EnvVar("...") and Dagster keeps them out of the UI; this resource never logs them."""

    host: str = Field(description="host name or address")
    port: int = 22
    user: str = Field(default_factory=getpass.getuser)
    key_file: str | None = Field(default=None, description="private key; empty: the SSH agent and ~/.ssh keys")
    key_passphrase: str | None = Field(default=None, description="passphrase of key_file (use dg.EnvVar)")
    password: str | None = Field(default=None, description="password login, if keys are not an option (use dg.EnvVar)")
    allow_agent: bool = True
    known_hosts: str = Field(default="~/.ssh/known_hosts", description="host keys are verified against this file")
    accept_unknown_host_key: bool = Field(default=False, description="accept a host key not in known_hosts (logged)")
    python: str = Field(default="python3", description="the host's Python, with the worker's dependencies")
    env: dict[str, str] = Field(default_factory=dict,
                                description="extra environment for the worker (CUDA_VISIBLE_DEVICES, HF_HOME)")
    code: Literal["upload", "installed"] = Field(
        default="upload", description="upload: run the control plane's own worker code, uploaded once per version "
                                      "(the host needs only the dependencies); installed: the host's installed "
                                      "eagle3-assets, which must be the same version")
    require_gpus: bool = Field(default=True, description="GPU stages fail fast on a host where nvidia-smi lists none "
                                                         "(false for a CPU-only host)")
    min_free_gb: float = Field(default=2.0, description="refuse to start a stage with less free disk under workdir")
    connect_timeout_s: float = 15.0
    keepalive_s: float = 15.0
    reconnect_within_s: float = Field(default=600.0, description="how long to keep reconnecting before failing the step "
                                                                 "(the job keeps running; a retry reattaches)")
    poll_s: float = Field(default=0.25, description="message polling interval while the job is busy")
    stop_grace_s: float = 20.0

    # ---- connection -------------------------------------------------------------------------------------
    def _target(self) -> SshTarget:
        return SshTarget(self.host, self.port, self.user, self.key_file, self.key_passphrase, self.password,
                         self.allow_agent, self.known_hosts, self.accept_unknown_host_key, self.connect_timeout_s,
                         self.keepalive_s)

    def _connect(self, warn) -> Connection:
        try:
            return Connection(self._target(), warn)
        except SshError as e:
            # a host that does not answer is marked so: the failover sensor moves its shard to another host. A config
            # error (key file, passphrase, host key, login) is not a dead host: no retry, no failover
            what = "the SSH host's settings are wrong" if e.config else "the SSH host did not answer"
            raise dg.Failure(description=f"{what}: {e}", allow_retries=not e.permanent,
                             metadata={UNREACHABLE: not e.permanent, CONFIG_ERROR: e.config}) from None

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    # ---- preflight --------------------------------------------------------------------------------------
    def _probe(self, conn: Connection, gpus: bool) -> dict:
        # with the worker's environment, so it sees what the worker will import
        args = {"workdir": self.workdir, "gpus": gpus}
        if self.code == "upload":
            args["code_dir"] = f"{self._abs_workdir(conn)}/.eagle3/code/{preflight.local_fingerprint()}"
        try:
            return conn.run_json([self.python, "-c", preflight.PROBE_SOURCE, json.dumps(args)],
                                 f"probing {self.where} with {self.python}", timeout_s=120, env=self.env or None)
        except RemoteCommandError as e:
            hint = " Set `python` to the host environment's interpreter." if e.rc == 127 else ""
            raise dg.Failure(description=str(e) + hint, allow_retries=False) from None
        except EnvNameError as e:  # a name in `env` no shell can export
            raise dg.Failure(description=f"{self.where}: {e}", allow_retries=False) from None

    def _abs_workdir(self, conn: Connection) -> str:
        wd = self.workdir
        if wd.startswith("~/") or wd == "~" or not wd.startswith("/"):
            home = conn.fs.ftp.normalize(".")
            wd = home + "/" + wd.lstrip("~").lstrip("/")
        return wd.rstrip("/") or "/"

    def _ready(self, context, conn: Connection, stage: str | None, gpus: bool | None = None,
               need_bytes: int | None = None) -> dict:
        """Probe the host, make sure the worker code is there, fail in seconds with every problem found."""
        gpus = self.require_gpus and (stage in preflight.GPU_STAGES if gpus is None else gpus)
        info = self._probe(conn, gpus)
        found = preflight.problems(info, where=self.where, gpus=gpus, min_free_bytes=int(self.min_free_gb * 1e9),
                                   code=self.code, need_bytes=need_bytes)
        if found:
            raise dg.Failure(description="the host is not ready:\n- " + "\n- ".join(found), allow_retries=False)
        info["code_dir"] = None
        if self.code == "upload":
            info["code_dir"] = self._upload_code(context, conn, info)
        context.log.info(f"host {self.where}: {preflight.summary(info)}")
        return info

    def _upload_code(self, context, conn: Connection, info: dict) -> str:
        """The worker code under .eagle3/code/<fingerprint>, checked file by file on every use (the probe
        hashes the copy there): missing, it is uploaded; changed on the host, it is restored."""
        fp = preflight.local_fingerprint()
        dest = f"{info['workdir']}/.eagle3/code/{fp}"
        pkg = info["package"]
        if pkg.get("fingerprint") == fp and pkg.get("dir", "").startswith(dest):
            return dest
        if conn.fs.exists(dest):
            self._restore_code(context, conn, dest, pkg.get("files", {}) if pkg.get("dir", "").startswith(dest) else {})
            return dest
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        for rel, data in preflight.local_code().items():
            _put_bytes(conn, data, f"{tmp}/eagle3_assets/{rel}")
        try:
            conn.fs.mv(tmp, dest)
            context.log.info(f"uploaded the worker code ({fp}) to {dest}")
        except OSError:  # another run uploaded the same version first; the next use checks that copy
            conn.fs.rm(tmp, recursive=True)
        return dest

    def _restore_code(self, context, conn: Connection, dest: str, there: dict) -> None:
        """Put back every worker file that differs from this control plane's, one atomic rename each (a job
        importing from the copy meanwhile sees the old file or the new, never half of one); remove extras."""
        mine = preflight.local_files()
        changed = sorted(rel for rel in mine if there.get(rel) != mine[rel])
        extra = sorted(set(there) - set(mine))
        for rel in changed:
            final = f"{dest}/eagle3_assets/{rel}"
            tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
            _put_bytes(conn, preflight.local_code()[rel], tmp)
            conn.fs.ftp.posix_rename(tmp, final)
        for rel in extra:
            conn.fs.rm(f"{dest}/eagle3_assets/{rel}")
        again = self._probe(conn, gpus=False)["package"]
        if again.get("fingerprint") != preflight.local_fingerprint() or not again.get("dir", "").startswith(dest):
            raise dg.Failure(description=f"{self.where}: the worker code in {dest} differs from this control plane's "
                                         f"and could not be restored (it now has {again.get('fingerprint')}): remove "
                                         f"{dest} on the host and run again", allow_retries=False)
        what = ", ".join(changed[:8] + [f"{r} (not ours, removed)" for r in extra[:8]])
        context.log.warning(f"the worker code in {dest} had been changed on the host ({what}); restored this control "
                            f"plane's version {preflight.local_fingerprint()} before running anything from it")

    def check(self, context, gpus: bool, need_bytes: int | None = None) -> dict:
        with self._connect(context.log.warning) as conn:
            return self._ready(context, conn, None, gpus=gpus, need_bytes=need_bytes)

    # ---- stages -----------------------------------------------------------------------------------------
    def run_stage(self, context: dg.AssetExecutionContext, stage: str, args: dict[str, Any]) -> StageRun:
        t0 = time.monotonic()
        with self._connect(context.log.warning) as conn:
            t_conn = time.monotonic()
            info = self._ready(context, conn, stage)
            t_ready = time.monotonic()
            workdir = info["workdir"]
            rundir = f"{workdir}/.eagle3/jobs/{_job_id(context, stage, args)}"
            reader = _RemoteMessages(f"{rundir}/messages.jsonl")
            with dg.open_pipes_session(context=context, context_injector=dg.PipesEnvContextInjector(),
                                       message_reader=reader, extras={"stage": stage}) as session:
                env = {**self.env, **session.get_bootstrap_env_vars(), NO_BAR_ENV: "1", "PYTHONUNBUFFERED": "1"}
                if info["code_dir"]:
                    env["PYTHONPATH"] = ":".join(p for p in (info["code_dir"], self.env.get("PYTHONPATH")) if p)
                # the arguments go in the job's own args.json (owner-only; jobs.py puts its path for ARGS_FILE): a
                # command line is readable by every user of the host (ps)
                spec = {"argv": [self.python, "-m", "eagle3_assets.worker", stage, "--workdir", workdir,
                                 "--args-file", ARGS_FILE], "args": args,
                        "env": env, "cwd": workdir, "stage": stage,
                        "attach_key": context.run.root_run_id or context.run_id,
                        # a finished job is reused only for the inputs it was made from, and the host files it
                        # read as they were (the worker's jobs module fingerprints them there)
                        "inputs": inputs.digest(inputs.input_versions(context)),
                        "sources": [args[a] for a in contract(stage).host_sources if args.get(a)]}
                try:
                    launched = self._launch(conn, rundir, spec, info["code_dir"])
                except Exception as e:  # launching again is safe: a job that did start is attached to
                    link = conn.client.get_transport() if conn.client else None
                    if type(e) is OSError and link is not None and link.is_active():  # not a timeout, not a reset
                        # the link is up and the host refused a write; SFTP names no cause ("Failure"), and a full
                        # disk is the common one: say what the probe saw
                        raise dg.Failure(description=(
                            f"{self.where}: writing the job's files under {rundir} failed ({type(e).__name__}: {e}); "
                            f"the disk of {info['disk']['path']} had {info['disk']['free_bytes'] / 1e6:,.1f} MB free a "
                            "moment before: if it is full, free space there or point the host's workdir at a bigger "
                            "disk; otherwise check that the SSH user may write there"), allow_retries=False) from e
                    if not is_link_error(e):
                        raise
                    conn.reconnect(self.reconnect_within_s)
                    launched = self._launch(conn, rundir, spec, info["code_dir"])
                if launched["action"] == "refused":
                    raise dg.Failure(description=f"{self.where}: {launched['reason']}", allow_retries=False)
                verb = "started the job" if launched["action"] == "started" else (
                    f"attached to the job an earlier attempt started ({launched['state']}; no second copy)")
                t_start = time.monotonic()
                context.log.info(f"{verb} on {self.where} in {rundir} (pid {launched.get('worker_pid')}, process "
                                 f"group {launched.get('pgid')}): connected in {t_conn - t0:.2f} s, host ready in "
                                 f"{t_ready - t_conn:.2f} s, job started in {t_start - t_ready:.2f} s")
                try:
                    ended, log_tail = self._follow(context, conn, rundir, reader.handler, info["code_dir"])
                except SshError as e:
                    raise dg.Failure(description=f"lost the connection to {self.where}: {e}. The job goes on in "
                                                 f"{rundir}; retrying this run reattaches to it",
                                     metadata={UNREACHABLE: True}) from None
                except BaseException:  # cancelled (or crashed here): never leave the job running unattended
                    self._stop(context, conn, rundir, info["code_dir"])
                    raise
        return stage_outcome(stage, ended.get("returncode"), session, log_tail, how=describe_exit(ended))

    def _jobs(self, conn: Connection, code_dir: str | None, *words: str, timeout_s: float = 60.0) -> dict:
        return conn.run_json([self.python, "-m", JOBS_MODULE, *words], f"{JOBS_MODULE} {words[0]}",
                             timeout_s=timeout_s, env={"PYTHONPATH": code_dir} if code_dir else None)

    def _launch(self, conn: Connection, rundir: str, spec: dict, code_dir: str | None) -> dict:
        jobs_dir = rundir.rsplit("/", 1)[0]
        conn.fs.makedirs(jobs_dir, exist_ok=True)
        spec_path = f"{jobs_dir}/.spec-{uuid.uuid4().hex}.json"
        with conn.fs.ftp.open(spec_path, "w") as f:
            f.chmod(0o600)  # the worker's environment may hold the user's tokens
            f.write(json.dumps(spec))
        return self._jobs(conn, code_dir, "launch", rundir, spec_path)

    def _follow(self, context, conn: Connection, rundir: str, handler, code_dir) -> tuple[dict, str]:
        """Feed the job's Pipes messages to Dagster until it ends; reconnect when the link drops."""
        messages, offset = f"{rundir}/messages.jsonl", 0
        delay, next_status = self.poll_s, time.monotonic() + 5.0
        while True:
            try:
                ended = conn.read_json(f"{rundir}/exit.json")  # read before the messages: all are in by then
                size = conn.size(messages)
                if size > offset:
                    data = conn.read_bytes(messages, offset, size - offset)
                    complete = data[: data.rfind(b"\n") + 1]  # a line counts once its newline is there
                    for line in complete.splitlines():
                        if line.strip():
                            handler.handle_message(json.loads(line))
                    offset += len(complete)
                if ended is not None:  # `size` was read after the exit: nothing more will come
                    return ended, self._log_tail(conn, rundir) if ended.get("returncode") else ""
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + 5.0
                    if ended is None and self._jobs(conn, code_dir, "status", rundir)["state"] == "vanished":
                        return {"returncode": None, "vanished": True}, self._log_tail(conn, rundir)
                # a quiet job is polled less often, but at least twice a second, so its end is seen quickly
                delay = self.poll_s if size > offset else min(delay * 1.5, max(self.poll_s, 0.5))
                time.sleep(delay)
            except Exception as e:
                if not is_link_error(e):
                    raise
                context.log.warning(f"lost the connection to {self.where} ({type(e).__name__}: {e}); the job goes on "
                                    f"on the host; reconnecting (for up to {self.reconnect_within_s:g} s)")
                t = time.monotonic()
                conn.reconnect(self.reconnect_within_s)
                context.log.info(f"reconnected to {self.where} after {time.monotonic() - t:.1f} s; resuming the job's "
                                 f"messages at byte {offset:,}")

    def _log_tail(self, conn: Connection, rundir: str, nbytes: int = 4000) -> str:
        try:
            size = conn.size(f"{rundir}/log")
            return conn.read_bytes(f"{rundir}/log", max(0, size - nbytes)).decode(errors="replace")
        except Exception:  # the tail is a courtesy; the exit status already says what happened
            return ""

    def _stop(self, context, conn: Connection, rundir: str, code_dir) -> None:
        try:
            if conn.client is None or not conn.client.get_transport() or not conn.client.get_transport().is_active():
                conn.reconnect(30.0)
            out = self._jobs(conn, code_dir, "stop", rundir, str(self.stop_grace_s), timeout_s=self.stop_grace_s + 30)
            context.log.warning(f"stopped the job in {rundir} on {self.where} ({describe_exit(out)})")
        except Exception as e:
            context.log.error(f"could not stop the job in {rundir} on {self.where} ({e}): stop it there by hand "
                              f"(python -m {JOBS_MODULE} stop '{rundir}')")

    # ---- files ------------------------------------------------------------------------------------------
    @contextmanager
    def files(self) -> Iterator[tuple[Any, str]]:
        with self._connect(lambda m: None) as conn:
            yield conn.fs, self._abs_workdir(conn)

    def put_file(self, local_path: str, rel_path: str) -> None:
        with self._connect(lambda m: None) as conn:
            dest = f"{self._abs_workdir(conn)}/{rel_path}"
            tmp = f"{dest.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex[:8]}-{dest.rsplit('/', 1)[1]}"
            conn.fs.put_file(local_path, tmp)
            conn.fs.ftp.posix_rename(tmp, dest)  # complete or absent, never half there

    def get_file(self, rel_path: str, local_path: str) -> None:
        with self._connect(lambda m: None) as conn:
            conn.fs.get_file(f"{self._abs_workdir(conn)}/{rel_path}", local_path)


def _put_bytes(conn: Connection, data: bytes, path: str) -> None:
    conn.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with conn.fs.ftp.open(path, "wb") as f:
        f.write(data)


def _job_id(context, stage: str, args: dict) -> str:
    """Same asset, partition, stage and arguments -> same run directory: what lets a retry find its job."""
    name = context.asset_key.to_python_identifier() if context.has_assets_def else stage
    if context.has_partition_key:
        name += "@" + re.sub(r"[^A-Za-z0-9_.-]", "_", context.partition_key)
    digest = hashlib.sha256(json.dumps([stage, args], sort_keys=True).encode()).hexdigest()[:12]
    return f"{name}-{digest}"
