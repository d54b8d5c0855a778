"""The target's Python started over ssh, with the system OpenSSH client.

`SshTransport` only changes how the target process is started: `ssh ... -- HOST '<python> -c
<bootstrap>'` instead of `<python> -c <bootstrap>`. The agent, its JSON and everything above the
transport are the same as for a local target.

- The user's ~/.ssh/config, ProxyJump, agent and known_hosts apply as for their own `ssh`.
- Never prompt and never hang: BatchMode=yes (cannot be overridden), a connect timeout, server
  keep-alives, host keys checked with StrictHostKeyChecking=accept-new by default (an unknown
  host's key is recorded, a changed key is refused). Options given with --ssh-option come first on
  the command line, so they win over these defaults (ssh uses the first value it sees).
- One ssh process, one connection and one remote interpreter per host: the agent is started
  once and answers each request (facts, then apply with its verification) on the same session,
  one JSON line in, one marked line out (see patcher.transport); `close()` ends it. Nothing to
  multiplex. Ending the session (closing ssh's input, or killing ssh) ends the remote agent:
  it stops when its input ends.
- Every word of the remote command is shell-quoted; the host comes after `--`, so nothing can
  be read as an ssh option; host strings are checked before any process starts.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass

from ..fleet.host_address import CONTROL_CHARACTER, Host, HostError, check_remote_python
from .interface import AgentFailure, TransportError, one_line_bootstrap
from .process import AgentProcess, AgentSession

DEFAULT_REMOTE_PYTHON = "python3"
DEFAULT_CONNECT_TIMEOUT = 10

_OPTION_KEY = re.compile(r"[A-Za-z][A-Za-z0-9]*\Z")


def shell_python(python: str) -> str:
    """The interpreter path as one word for the remote shell, quoted. A leading `~/` is the login
    (or become) user's home, `"$HOME"/...` with the rest still quoted, in patcher's ssh command and
    the Ansible task's alike."""
    if python.startswith("~/") and len(python) > 2:
        return '"$HOME"/' + shlex.quote(python[2:])
    return shlex.quote(python)


# ssh options patcher's command line never passes on: those that run a local command or load code
# into ssh (a command line is often built by scripts from other input; a configuration file, an
# inventory's ansible_ssh_common_args, is trusted as any ssh_config is), and those that would take
# the session from patcher (prompting, a command or a tty of their own, ssh going to background).
REFUSED_SSH_OPTIONS = {
    "ProxyCommand": "runs a local command",
    "LocalCommand": "runs a local command",
    "PermitLocalCommand": "lets LocalCommand run a local command",
    "KnownHostsCommand": "runs a local command",
    "PKCS11Provider": "loads a local library into ssh",
    "SecurityKeyProvider": "loads a local library into ssh",
    "BatchMode": "would let ssh prompt, and patcher never does",
    "RemoteCommand": "replaces the command patcher runs on the host",
    "SessionType": "replaces the command patcher runs on the host",
    "RequestTTY": "gives the session a tty, which mangles the agent's answers",
    "StdinNull": "takes the agent's input away",
    "ForkAfterAuthentication": "sends ssh to the background, away from patcher's session",
}
_REFUSED_BY_KEY = {key.lower(): key for key in REFUSED_SSH_OPTIONS}


def check_ssh_option(option: str) -> str:
    """`Key=Value` as for `ssh -o`, and none of REFUSED_SSH_OPTIONS."""
    key, sep, value = option.partition("=")
    key = key.strip()
    if not sep or not _OPTION_KEY.match(key) or option.startswith("-") or CONTROL_CHARACTER.search(option):
        raise HostError(
            f"refusing --ssh-option {option!r}: expected KEY=VALUE as for ssh -o, e.g. IdentityFile=~/.ssh/gpu"
        )
    refused = _REFUSED_BY_KEY.get(key.lower())
    if refused is not None:
        raise HostError(
            f"refusing --ssh-option {refused}: it {REFUSED_SSH_OPTIONS[refused]}; patcher's command line takes none "
            f"of {', '.join(REFUSED_SSH_OPTIONS)} (put one you trust in an ssh configuration file: --ssh-config "
            "FILE, or ~/.ssh/config)"
        )
    return f"{key}={value.strip()}"


def check_settings(settings: SshSettings) -> None:
    """What ssh would refuse for every host, refused once before any host is started (exit 2):
    a --ssh-config file that is not there, an --ssh-option ssh cannot parse (`ssh -G` reads the
    options and prints the configuration without connecting; it runs only when options are given)."""
    config = settings.config_file
    if config is not None:
        if not os.path.isfile(config):
            raise HostError(
                f"--ssh-config {config}: no such file; name an ssh client configuration file (as for ssh -F)"
            )
        if not os.access(config, os.R_OK):
            raise HostError(f"--ssh-config {config}: not readable by this user; fix its permissions or name another")
    if not settings.options:
        return
    base = [settings.ssh, "-G"] + (["-F", config] if config else []) + ["-o", "BatchMode=yes"]

    def refusal(options) -> str | None:
        args = base + [word for option in options for word in ("-o", option)] + ["--", "patcher-check.invalid"]
        try:
            proc = subprocess.run(
                args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False
            )
        except FileNotFoundError:
            raise HostError(f"no `{settings.ssh}` client on this machine; install OpenSSH") from None
        except subprocess.TimeoutExpired:
            return None  # a Match exec that hangs: the hosts' own ssh will say
        lines = [line.strip().rstrip(".") for line in proc.stderr.splitlines() if line.strip()]
        return (lines[0] if lines else f"ssh exit status {proc.returncode}") if proc.returncode else None

    if refusal(settings.options) is None:
        return
    if config and refusal(()) is not None:
        raise HostError(f"--ssh-config {config}: ssh refuses it ({refusal(())}); fix the file")
    for option in settings.options:
        why = refusal((option,))
        if why is not None:
            raise HostError(f"--ssh-option {option}: ssh refuses it ({why}); fix or drop it")
    raise HostError(f"ssh refuses the --ssh-option values together ({refusal(settings.options)}); fix or drop them")


@dataclass
class SshSettings:
    """What every host of a run shares."""

    ssh: str = "ssh"
    options: tuple[str, ...] = ()  # KEY=VALUE, from --ssh-option
    config_file: str | None = None  # -F, from --ssh-config
    connect_timeout: int = DEFAULT_CONNECT_TIMEOUT
    sudo: bool = False


class SshTransport(AgentSession):
    """A target interpreter on another host, started with the system `ssh`: the same agent session
    as a local one (its AgentProcess), started and explained the ssh way
    (patcher.transport.interface.Transport)."""

    def __init__(self, host: Host, python: str | None, settings: SshSettings) -> None:
        python = host.python or python or DEFAULT_REMOTE_PYTHON
        check_remote_python(python)
        self.python = python
        self.host = host
        self.settings = settings
        self.agent = AgentProcess(python)

    @property
    def label(self) -> str:
        return self.host.name

    @property
    def sudo(self) -> bool:
        return self.settings.sudo or self.host.become

    def _sudo_source(self) -> str:
        return "--sudo" if self.settings.sudo else "ansible_become from the inventory"

    # -------------------------------------------------------------- the command line

    def ssh_args(self) -> list[str]:
        s = self.settings
        args = [s.ssh]
        if s.config_file:
            args += ["-F", s.config_file]
        args += ["-o", "BatchMode=yes"]  # first value wins in ssh: nothing can turn prompting back on
        for option in s.options:
            args += ["-o", option]
        args += list(self.host.ssh_args)  # the inventory's: before patcher's defaults, so they win
        if self.host.key_file:
            args += ["-i", self.host.key_file]
        args += [
            "-o",
            f"ConnectTimeout={s.connect_timeout}",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            "ServerAliveInterval=10",
            "-o",
            "ServerAliveCountMax=3",
        ]
        if self.host.port:
            args += ["-p", str(self.host.port)]
        if self.host.user:
            args += ["-l", self.host.user]
        return args

    def remote_command(self) -> str:
        """`PYTHON -c SESSION_BOOTSTRAP` for the remote shell, every word quoted (shell_python)."""
        python = shell_python(self.python)
        words = [python, "-c", shlex.quote(one_line_bootstrap())]  # one line: tcsh's and fish's too
        if self.sudo:
            words = ["sudo", "-n", "--", *words]
        return " ".join(words)

    def command(self) -> list[str]:
        return [*self.ssh_args(), "--", self.host.address, self.remote_command()]

    # -------------------------------------------------------------- what went wrong (ssh)

    def cannot_start(self, exc: OSError) -> TransportError:
        if isinstance(exc, FileNotFoundError):
            return TransportError("usage", f"no `{self.settings.ssh}` client on this machine; install OpenSSH")
        return TransportError(
            "usage", f"`{self.settings.ssh}` cannot be run here ({exc.strerror}); install OpenSSH or fix its path"
        )

    def agent_failure(self, kind: str, message: str) -> AgentFailure:
        if kind == "not-writable" and not self.sudo:
            message += "; if the login user may sudo, try --sudo"
        return AgentFailure(kind, message)

    def status_command(self) -> str:
        return f"patcher status --host {self.host.spec}"

    def startup_allowance(self, answered: bool) -> float:
        """The first answer also waits for the connection (bounded by ssh's ConnectTimeout)."""
        return 0.0 if answered else float(self.settings.connect_timeout)

    def ended(self, returncode: int, stderr: bytes, noise: list[str], outcome_hint: str) -> TransportError:
        """A failed ssh invocation, as a precise status and one line for the user."""
        lines = [
            line.strip()
            for line in stderr.decode("utf-8", "replace").splitlines()
            if line.strip() and not line.startswith("Warning: Permanently added") and not set(line.strip()) <= {"@"}
        ]
        text = "\n".join(lines)
        last = lines[-1] if lines else f"ssh exit status {returncode}"
        host = self.host
        where = f"{host.address}" + (f" port {host.port}" if host.port else "")
        if returncode < 0:  # the ssh client itself was killed: the connection went with it
            return TransportError(
                "unreachable", f"connection lost (ssh was killed by signal {-returncode})" + outcome_hint
            )
        if returncode == 255:
            return self._connection_failure(text, last, where, outcome_hint)
        refused_by_sudo = self._sudo_refusal(returncode, text, last) if self.sudo else None
        if refused_by_sudo is not None:
            return refused_by_sudo
        if returncode == 127:
            return self._no_python()
        if returncode == 126:
            return TransportError(
                "usage",
                f"{self.python} cannot be executed on {host.address} ({last}); name the interpreter with --python",
            )
        return TransportError(
            "usage",
            f"{self.python} did not answer as a Python 3.9+ interpreter ({last}); name one with --python",
        )

    def _connection_failure(self, text: str, last: str, where: str, outcome_hint: str) -> TransportError:
        """ssh's own exit status 255: its configuration, the host key, authentication or the network."""
        host = self.host
        changed = (
            "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or "has changed and you have requested strict" in text
        )
        refused = "Host key verification failed" in text
        if re.search(
            r"Bad configuration option|bad configuration options|Can't open user config file|"
            r"command-line line \d+:|: line \d+: ",
            text,
        ):
            return TransportError(
                "usage", f"ssh refuses its configuration ({last}); fix it (~/.ssh/config, --ssh-config, --ssh-option)"
            )
        # The connection never reached this host's own key exchange: it failed on the way,
        # at a ProxyJump host, whose ssh does not get patcher's -o options (accept-new).
        via_jump = "kex_exchange_identification" in text or "UNKNOWN port 65535" in text
        if (changed or refused) and via_jump:
            return self._jump_host_key(changed)
        if refused and not changed and re.search(r"No \S+ host key is known", text):
            return TransportError(
                "unreachable",
                "host key unknown and strict checking is on: check the key, then add "
                "it to known_hosts (ssh-keyscan), or use StrictHostKeyChecking=accept-new",
            )
        if changed or refused:
            return TransportError(
                "unreachable",
                f"host key changed: check it, then remove the old key with ssh-keygen -R '{host.known_hosts_name}'",
            )
        if "Permission denied" in text or "Too many authentication failures" in text:
            user = host.user or "the default user"
            return TransportError(
                "unreachable",
                f"authentication refused for {user} ({last}); check the key (ssh-agent, IdentityFile) and the user",
            )
        if "Connection refused" in text:
            return TransportError("unreachable", f"connection refused by {where}: is sshd running there?")
        if "timed out" in text:
            return TransportError("unreachable", f"connection to {where} timed out")
        if "No route to host" in text or "Network is unreachable" in text:
            return TransportError("unreachable", f"no route to {where}")
        if "Could not resolve hostname" in text or "Name or service not known" in text:
            return TransportError("unreachable", f"cannot resolve {host.address}")
        return TransportError("unreachable", f"connection lost ({last})" + outcome_hint)

    def _sudo_refusal(self, returncode: int, text: str, last: str) -> TransportError | None:
        """--sudo: what sudo -n refused, if it did."""
        host = self.host
        if "a password is required" in text or "a terminal is required" in text:
            return TransportError(
                "usage",
                f"sudo -n refused: {host.user or 'the login user'} may not run "
                f"{self.python} without a password there (sudoers NOPASSWD), or drop {self._sudo_source()}",
            )
        if "must have a tty" in text:
            return TransportError(
                "usage",
                f"sudo refused: `requiretty` is set for {host.user or 'the login user'} there; "
                f"allow it without a tty (Defaults !requiretty) or drop {self._sudo_source()}",
            )
        if "not in the sudoers" in text or "not allowed to execute" in text or "may not run sudo" in text:
            return TransportError("usage", f"sudo refused: {last}")
        if returncode == 127 and re.search(r"\bsudo: (command )?not found|sudo: No such file", text):
            return TransportError("usage", f"no sudo on {host.address}; drop {self._sudo_source()}")
        if re.search(r"sudo: .*(command not found|No such file)", text):
            return self._no_python()
        return None

    def _jump_host_key(self, changed: bool) -> TransportError:
        jump = self._proxy_jump() or "the jump host"
        rest = jump.removeprefix("ssh://").rpartition("@")[2]  # [user@]host[:port], [user@][v6/v4]:port
        if rest.startswith("["):
            host, _, port = rest[1:].partition("]")
            port = port.lstrip(":")
        elif rest.count(":") == 1:
            host, _, port = rest.partition(":")
        else:
            host, port = rest, ""
        if changed:
            name = f"[{host}]:{port}" if port and port != "22" else host
            return TransportError(
                "unreachable",
                f"the jump host's key changed (ProxyJump {jump}): check it, then remove the old key with "
                f"ssh-keygen -R '{name}'",
            )
        scan = f"ssh-keyscan {'-p ' + port + ' ' if port else ''}{host}"
        return TransportError(
            "unreachable",
            f"the jump host's key is unknown (ProxyJump {jump}): patcher's StrictHostKeyChecking=accept-new does "
            f"not reach ssh's connection to a jump host; check its key and add it to known_hosts ({scan}), "
            "or log in to it once with ssh",
        )

    def _proxy_jump(self) -> str | None:
        """The ProxyJump ssh uses for this host (`ssh -G`: the configuration, no connection)."""
        args = [*self.ssh_args(), "-G", "--", self.host.address]
        try:
            out = subprocess.run(
                args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in out.splitlines():
            key, _, value = line.partition(" ")
            if key == "proxyjump" and value.strip() not in ("", "none"):
                return value.strip().split(",")[0]  # the first hop is the one connected to first
        return None

    def _no_python(self) -> TransportError:
        return TransportError(
            "usage",
            f"no python at {self.python} on {self.host.address}; name it with --python "
            "(or ansible_python_interpreter in the inventory)",
        )
