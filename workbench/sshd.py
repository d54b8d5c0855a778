"""Real OpenSSH servers for the remote tests and benchmarks, on loopback addresses only (127.0.0.0/8).

Each `SshServer` is Debian's `sshd` run in the foreground (`sshd -D -e -f <config>`) on one
127.0.0.x address and a free port, with its own host key; `SshClient` is a private client
configuration (key, known_hosts, `-F` file) so nothing under ~/.ssh is read or written.
Needs root (sshd must run as root to log users in) and `/usr/sbin/sshd`.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
LOOPBACK_PREFIX = "127.0.0."


def why_no_sshd() -> str | None:
    """Why the remote tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "sshd must run as root to log users in; run the tests as root (CI does)"
    if not Path(SSHD).exists():
        return f"{SSHD} is missing: apt-get install openssh-server (.ci/bootstrap does it as root)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "the OpenSSH client (ssh, ssh-keygen) is missing"
    return None


def keygen(path: Path, comment: str = "patcher-test") -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    return path


def is_loopback(address: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(address) in ipaddress.ip_network("127.0.0.0/8")


def free_port(address: str) -> int:
    assert is_loopback(address), f"loopback addresses only, not {address}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


class SshServer:
    """One sshd on `address` (127.0.0.x), logging to <dir>/sshd.log."""

    def __init__(
        self, directory: Path, address: str, authorized: dict[str, str], port: int | None = None, extra_config: str = ""
    ) -> None:
        """`extra_config`: more sshd_config lines (e.g. a ForceCommand)."""
        assert is_loopback(address), f"tests use loopback addresses only, not {address}"
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.address = address
        self.port = port or free_port(address)
        self.host_key = self.dir / "ssh_host_ed25519_key"
        keygen(self.host_key, f"host-{address}")
        # sshd reads authorized keys as the logging-in user: keep them where any user can read
        # (pytest's temporary folders are private to root).
        keys = Path(tempfile.mkdtemp(prefix="patcher-sshd-keys-", dir="/tmp"))
        os.chmod(keys, 0o755)
        self.keys_dir = keys
        for user, public_key in authorized.items():
            (keys / user).write_text(public_key)
            os.chmod(keys / user, 0o644)
        self.config = self.dir / "sshd_config"
        self.config.write_text(
            f"ListenAddress {address}:{self.port}\n"
            f"HostKey {self.host_key}\n"
            "PidFile none\n"
            f"AuthorizedKeysFile {keys}/%u\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "UseDNS no\n"
            "MaxStartups 100:30:200\n"
            "Subsystem sftp internal-sftp\n"
            "LogLevel INFO\n" + extra_config
        )
        self.proc: subprocess.Popen | None = None

    @property
    def spec(self) -> str:
        return f"{self.address}:{self.port}"

    def start(self, timeout: float = 10) -> SshServer:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        with open(self.dir / "sshd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                with socket.create_connection((self.address, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {self.spec} did not listen within {timeout}s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return (self.dir / "sshd.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def sessions(self) -> list[int]:
        """Pids of the per-connection sshd processes (children of the listener)."""
        if self.proc is None:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid:
                found.append(int(entry.name))
        return found

    def drop_connections(self) -> list[int]:
        """Kill every connection's sshd process (SIGKILL): the network cable pulled out."""
        pids = self.sessions()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        self.drop_connections()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.keys_dir, ignore_errors=True)

    def new_host_key(self) -> None:
        """Regenerate the host key and restart: what a reinstalled host (or an attacker) looks like."""
        self.stop()
        for path in (self.host_key, self.host_key.with_suffix(".pub")):
            path.unlink(missing_ok=True)
        keygen(self.host_key, f"host-{self.address}-new")
        self.start()


class SshClient:
    """A client configuration of its own: identity, known_hosts, and an `-F` file using them."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = keygen(self.dir / "id_ed25519")
        self.public_key = (self.dir / "id_ed25519.pub").read_text()
        self.known_hosts = self.dir / "known_hosts"
        self.known_hosts.touch()
        self.config = self.dir / "ssh_config"
        self.config.write_text(
            "Host *\n"
            f"  IdentityFile {self.key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.known_hosts}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  PasswordAuthentication no\n"
            "  KbdInteractiveAuthentication no\n"
        )

    def args(self) -> list[str]:
        """The patcher options that make it use this client configuration."""
        return ["--ssh-config", str(self.config)]


def ensure_user(name: str) -> pwd.struct_passwd:
    """A login user for the tests (no password, not locked, /bin/sh), created once."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/bin/sh", name], check=True, capture_output=True)
        # "*": no password can match, and the account is not locked ("!"), so key logins work.
        subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)
        return pwd.getpwnam(name)


_addresses = itertools.count(2)


def next_address() -> str:
    """A loopback address of its own for each server a test session starts (127.0.0.2 on)."""
    number = next(_addresses)
    assert number < 255, "out of loopback addresses for this session"
    return f"127.0.0.{number}"


def spec(server: SshServer, user: str = "root") -> str:
    """The --host value that reaches `server` as `user`."""
    return f"{user}@{server.address}:{server.port}"
