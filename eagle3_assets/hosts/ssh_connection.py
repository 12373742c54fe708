"""One verified paramiko connection to a GPU host: host keys checked against known_hosts, errors that name
their cause, remote commands built only from quoted words, files through fsspec's SFTP filesystem, and
reconnection with backoff when the link drops."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import paramiko
from fsspec.implementations.sftp import SFTPFileSystem

from ..common.secrets import scrub, secret_kind


class SshError(Exception):
    """A connection problem with a message for the user. `permanent`: retrying will not help. `config`: the
    host's settings are wrong (a key file, a passphrase, a host key), not the host: no retry, no failover."""

    def __init__(self, message: str, permanent: bool, config: bool = False):
        super().__init__(scrub(message))  # a message may quote what the user gave: never a secret in it
        self.permanent = permanent or config
        self.config = config


# What a dropped or broken link raises mid-operation (FileNotFoundError etc. are answers, not drops).
LINK_ERRORS = (paramiko.SSHException, EOFError, ConnectionError, socket.timeout, TimeoutError, BrokenPipeError)


def is_link_error(e: BaseException) -> bool:
    if isinstance(e, LINK_ERRORS):
        return True
    # paramiko raises plain OSError("Socket is closed") once the transport is gone
    return type(e) is OSError and e.errno is None


@dataclass(frozen=True)
class SshTarget:
    host: str
    port: int
    user: str
    key_file: str | None
    key_passphrase: str | None
    password: str | None
    allow_agent: bool
    known_hosts: str
    accept_unknown_host_key: bool
    timeout_s: float
    keepalive_s: float

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


class _WarnAndAccept(paramiko.MissingHostKeyPolicy):
    """The explicit opt-in for unknown host keys: accept for this connection, say so loudly."""

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn

    def missing_host_key(self, client, hostname, key):
        self.warn(f"accepting the unknown host key of {hostname} ({key.get_name()} {_fingerprint(key)}) because "
                  f"accept_unknown_host_key is set; add it to known_hosts to have it verified")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()


def _looks_like_key_text(value: str) -> bool:
    return "\n" in value or "-----BEGIN" in value or len(value) > 1024 or secret_kind(value) is not None


def private_key(t: SshTarget) -> paramiko.PKey | None:
    """key_file read here, before any connection, so that a wrong path, a wrong passphrase or key text where a path
    goes fail as what they are (config errors naming the field), not as an unreachable host."""
    if not t.key_file:
        return None
    if _looks_like_key_text(t.key_file):
        raise SshError("key_file: this looks like key text, not a path (not shown): save the private key in a file "
                       "only you can read (chmod 600 ~/.ssh/gpu_host_key) and set key_file to its path, or load it "
                       "into the SSH agent (ssh-add) and leave key_file empty", permanent=True, config=True)
    path = os.path.expanduser(t.key_file)
    try:
        return paramiko.PKey.from_path(path, t.key_passphrase.encode() if t.key_passphrase else None)
    except OSError as e:
        raise SshError(f"key_file {t.key_file}: {e.strerror or e} on the machine that runs the Dagster step: set key_file "
                       "to the path of a private key there, readable by the user the step runs as",
                       permanent=True, config=True) from None
    except TypeError:  # cryptography: "password was not given but private key is encrypted"
        raise SshError(f"key_file {t.key_file} is encrypted: set key_passphrase (through an environment variable, "
                       "dg.EnvVar)", permanent=True, config=True) from None
    except (ValueError, paramiko.SSHException) as e:
        if t.key_passphrase:
            raise SshError(f"key_file {t.key_file} could not be opened with key_passphrase: the passphrase is wrong "
                           "(check the environment variable it comes from), or the file is not a private key",
                           permanent=True, config=True) from None
        raise SshError(f"key_file {t.key_file} is not a private key this SSH client reads ({e}): give the private "
                       "half (not the .pub) of an ed25519, ECDSA or RSA key", permanent=True, config=True) from None


def open_client(t: SshTarget, warn: Callable[[str], None]) -> paramiko.SSHClient:
    pkey = private_key(t)
    client = paramiko.SSHClient()
    known = os.path.expanduser(t.known_hosts)
    if os.path.exists(known):
        client.load_host_keys(known)
    client.set_missing_host_key_policy(_WarnAndAccept(warn) if t.accept_unknown_host_key else paramiko.RejectPolicy())
    try:
        client.connect(t.host, port=t.port, username=t.user, pkey=pkey, password=t.password, allow_agent=t.allow_agent,
                       look_for_keys=t.key_file is None and t.password is None, timeout=t.timeout_s,
                       banner_timeout=t.timeout_s, auth_timeout=t.timeout_s, channel_timeout=t.timeout_s)
    except paramiko.BadHostKeyException as e:
        client.close()
        raise SshError(
            f"the host key of {t.known_hosts_name} does not match {known}: it offered {e.key.get_name()} "
            f"{_fingerprint(e.key)}, known_hosts has {_fingerprint(e.expected_key)}. If the host was reinstalled, "
            f"remove the old entry (ssh-keygen -R '{t.known_hosts_name}' -f {known}) and add the new key after "
            f"checking it; otherwise the connection may be intercepted", permanent=True, config=True) from None
    except paramiko.PasswordRequiredException:  # one of ~/.ssh's keys (key_file is opened before connecting)
        client.close()
        raise SshError("a key in ~/.ssh is encrypted: set key_file to it and key_passphrase (through an environment "
                       "variable, dg.EnvVar), or load it into the SSH agent (ssh-add)", permanent=True,
                       config=True) from None
    except paramiko.AuthenticationException as e:
        client.close()
        how = f"key file {t.key_file}" if t.key_file else ("a password" if t.password else "the agent's and ~/.ssh keys")
        raise SshError(f"{t.where} refused authentication with {how} ({e}): check the user and that the key's "
                       f"public half is in that user's ~/.ssh/authorized_keys", permanent=True, config=True) from None
    except paramiko.SSHException as e:
        client.close()
        if "not found in known_hosts" in str(e):
            raise SshError(
                f"the host key of {t.known_hosts_name} is not in {known}: add it after checking its fingerprint "
                f"(ssh-keyscan -p {t.port} {t.host} >> {known}), or set accept_unknown_host_key: true to accept "
                f"it unverified", permanent=True, config=True) from None
        raise SshError(f"SSH to {t.where} failed: {e}", permanent=False) from None
    except (TimeoutError, OSError) as e:  # refused, unreachable, DNS, timeout
        client.close()
        raise SshError(f"cannot reach {t.host}:{t.port} ({e}): check host, port and that sshd runs there",
                       permanent=False) from None
    client.get_transport().set_keepalive(int(t.keepalive_s))
    return client


class HostFileSystem(SFTPFileSystem):
    """fsspec's SFTP filesystem on our verified client (its own connect would accept any host key)."""

    def __init__(self, client: paramiko.SSHClient, host: str):
        self._client = client
        super().__init__(host, skip_instance_cache=True)

    def _connect(self):
        self.client = self._client
        self.ftp = self._client.open_sftp()


class Connection:
    """A live connection (client + SFTP filesystem) that can reconnect. Not thread-safe; one per stage."""

    def __init__(self, target: SshTarget, warn: Callable[[str], None], connect_attempts: int = 3):
        self.target, self.warn = target, warn
        self.client: paramiko.SSHClient | None = None
        self.fs: HostFileSystem | None = None
        self._open(attempts=connect_attempts, deadline=None)

    def _open(self, attempts: int | None, deadline: float | None) -> None:
        delay, n = 0.5, 0
        while True:
            n += 1
            try:
                self.client = open_client(self.target, self.warn)
                self.fs = HostFileSystem(self.client, self.target.host)
                return
            except SshError as e:
                out_of_time = deadline is not None and time.monotonic() + delay > deadline
                if e.permanent or (attempts is not None and n >= attempts) or out_of_time:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 15.0)

    def reconnect(self, within_s: float) -> None:
        """Drop the old link and connect again, backing off, for at most `within_s` seconds."""
        self.close()
        self._open(attempts=None, deadline=time.monotonic() + within_s)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # closing a dead transport can raise; there is nothing left to release
                pass
        self.client = self.fs = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, words: list[str], timeout_s: float = 60.0, env: dict | None = None) -> tuple[int, str, str]:
        """Run a command given as words; each word is quoted, so nothing in it reaches the shell as syntax.
        `env` goes through the command's stdin, never its command line: every process's command line on the
        host is readable by every user there (ps), and the environment may hold tokens."""
        cmd = " ".join(shlex.quote(w) for w in words)
        script = env_script(env) if env else None
        if script:
            cmd = f"sh -c {shlex.quote(_ENV_FROM_STDIN)} sh {cmd}"
        stdin, stdout, stderr = self.client.exec_command(cmd, timeout=timeout_s)
        if script:
            stdin.write(script)
            stdin.flush()
            stdin.channel.shutdown_write()
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
        rc = stdout.channel.recv_exit_status()
        if rc == -1:  # the channel closed without an exit status: the link dropped, the command may not have run
            raise paramiko.SSHException("the connection dropped before the remote command finished")
        return rc, out, err

    def run_json(self, words: list[str], what: str, timeout_s: float = 60.0, env: dict | None = None) -> dict:
        rc, out, err = self.run(words, timeout_s, env)
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            raise RemoteCommandError(what, words[0], rc, (err or out).strip())
        return json.loads(lines[-1])

    def read_bytes(self, path: str, offset: int = 0, limit: int | None = None) -> bytes:
        with self.fs.ftp.open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit) if limit is not None else f.read()

    def read_json(self, path: str):
        try:
            return json.loads(self.read_bytes(path))
        except FileNotFoundError:
            return None

    def size(self, path: str) -> int:
        try:
            return self.fs.ftp.stat(path).st_size or 0
        except FileNotFoundError:
            return 0


# Reads `NAME='value'` lines from stdin (exported), then becomes the command: the values never touch an argv.
_ENV_FROM_STDIN = 'set -a && eval "$(cat)" && set +a && exec "$@"'
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvNameError(ValueError):
    pass


def env_script(env: dict) -> str:
    bad = [k for k in env if not _ENV_NAME.fullmatch(k)]
    if bad:
        raise EnvNameError(f"environment variable names {bad} are not valid (letters, digits, _; not starting with a "
                         "digit): fix the host's `env`")
    return "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in env.items())


class RemoteCommandError(Exception):
    def __init__(self, what: str, program: str, rc: int, output: str):
        self.what, self.program, self.rc, self.output = what, program, rc, output
        if rc == 127:
            msg = f"{what}: the host has no {program!r} (exit 127: {output[-500:]})"
        else:
            msg = f"{what} failed on the host (exit {rc}): {output[-2000:]}"
        super().__init__(msg)
