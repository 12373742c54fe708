"""A real OpenSSH server on 127.0.0.1 for the SSH host's tests: its own host key, an authorized client
key (plus an encrypted one), a known_hosts file, and a way to cut every live connection."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path, passphrase: str = "") -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)], check=True)


CPU_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "EAGLE3_CPU_BF16")


class SshServer:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.host_key = root / "host_ed25519"
        self.client_key = root / "id_ed25519"
        self.encrypted_key = root / "id_encrypted"
        self.passphrase = "correct horse battery staple"
        self.stranger_key = root / "id_stranger"  # valid key, not authorized
        for key, phrase in [(self.host_key, ""), (self.client_key, ""), (self.encrypted_key, self.passphrase),
                            (self.stranger_key, "")]:
            _keygen(key, phrase)
        (root / "authorized_keys").write_text(
            (root / "id_ed25519.pub").read_text() + (root / "id_encrypted.pub").read_text())
        host_pub = (root / "host_ed25519.pub").read_text().split()
        self.known_hosts = root / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.config = root / "sshd_config"
        self.config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {root / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "MaxStartups 100",
            "MaxSessions 100", "Subsystem sftp internal-sftp", "LogLevel INFO",
            # the "remote" host is this machine: a CPU emulated for the tests (AVX2 only, no bf16) is emulated
            # for its sessions too, or a stage run over SSH computes with other kernels than the same stage here
            *([f"SetEnv {' '.join(f'{k}={os.environ[k]}' for k in CPU_ENV if k in os.environ)}"]
              if any(k in os.environ for k in CPU_ENV) else []), ""]))
        self.log = root / "sshd.log"
        self.proc: subprocess.Popen | None = None
        self.user = os.environ.get("USER") or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()

    def start(self) -> SshServer:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.port}: {self.log.read_text()[-2000:]}")

    def session_pids(self) -> list[int]:
        """The per-connection sshd children of the listener."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def cut_connections(self) -> int:
        """Kill every connection's sshd process, as a network drop or a host-side sshd restart would."""
        pids = self.session_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
