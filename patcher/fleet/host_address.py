"""The host-address grammar: how a host is written (`[user@]HOST[:PORT]`, `[user@][IPv6]:PORT`, a
bare IPv6 address; a user name, a host name or address, a port, a remote interpreter), checked
before any process starts, and Host, one target host as the fleet knows it (from --host or an
inventory). Standard library only and knowing nothing of a run, so the ground layer
(tests/test_layout.py's LAYERS): the fleet (fleet/inventory.py) parses hosts with it and the ssh
transport (transport/ssh.py), below the fleet, takes a Host."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
_HOSTNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


class HostError(ValueError):
    """A host string (or a remote path) that is refused before anything runs: exit 2."""


@dataclass(frozen=True)
class Host:
    """One target host. `name` is how reports and retry files call it; `address` is what ssh is
    given (a name from ~/.ssh/config, a DNS name or an IP address)."""

    name: str
    address: str
    user: str | None = None
    port: int | None = None
    python: str | None = None  # per-host interpreter (ansible_python_interpreter); None: --python
    become: bool = False  # through `sudo -n` (ansible_become), as --sudo does for every host
    key_file: str | None = None  # ansible_ssh_private_key_file: `ssh -i`
    # ansible_ssh_common_args + ansible_ssh_extra_args, split as a shell would: from inventory
    # files only (trusted like an ssh_config: ProxyCommand runs local commands), never the command line
    ssh_args: tuple[str, ...] = ()
    # the inventory groups it belongs to, for --limit; not part of what the host is
    groups: tuple[str, ...] = field(default=(), compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)  # e.g. inventory variables ignored

    @property
    def spec(self) -> str:
        """`[user@]host[:port]` as it would be written on the command line."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return (f"{self.user}@" if self.user else "") + host + (f":{self.port}" if self.port else "")

    @property
    def known_hosts_name(self) -> str:
        """The name ssh files the host key under (what `ssh-keygen -R` wants)."""
        if self.port and self.port != 22:
            return f"[{self.address}]:{self.port}"
        return self.address


def check_free_text(what: str, text: str) -> None:
    if not text:
        raise HostError(f"empty {what}")
    if text.startswith("-"):
        raise HostError(f"refusing {what} {text!r}: it starts with '-' and could be read as an ssh option")
    if CONTROL_CHARACTER.search(text):
        raise HostError(f"refusing {what} {text!r}: it contains a control character")
    if any(c.isspace() for c in text):
        raise HostError(f"refusing {what} {text!r}: it contains whitespace")


def check_user(user: str) -> str:
    check_free_text("user name", user)
    if not _USER.match(user):
        raise HostError(f"refusing user name {user!r}: only letters, digits, '.', '_' and '-' are allowed")
    return user


def check_address(address: str) -> str:
    """A host name or an IP address (IPv6 without brackets)."""
    check_free_text("host", address)
    if ":" in address:
        literal = address.split("%", 1)
        try:
            ipaddress.IPv6Address(literal[0])
        except ValueError:
            raise HostError(f"refusing host {address!r}: not an IPv6 address") from None
        if len(literal) == 2 and not re.fullmatch(r"[A-Za-z0-9_.-]+", literal[1]):
            raise HostError(f"refusing host {address!r}: bad IPv6 zone")
        return address
    if not _HOSTNAME.match(address):
        # ASCII only: a fullwidth or other Unicode letter is alphanumeric to Python, not to DNS or ssh
        bad = sorted({c for c in address if not (c.isascii() and c.isalnum() or c in "._-")})
        named = ", ".join(repr(c) if c.isascii() else f"{c!r} (U+{ord(c):04X})" for c in bad)
        if not bad:  # only a '.' first fails the pattern otherwise
            named = f"{address[0]!r} first"
        raise HostError(
            f"refusing host {address!r}: {named} not allowed in a host name "
            "(ASCII letters, digits, '.', '_' and '-' only, not '.' or '-' first)"
        )
    return address


def check_port(port: str | int) -> int:
    text = str(port)
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise HostError(f"refusing port {text!r}: a number from 1 to 65535")
    return int(text)


def check_remote_python(python: str) -> str:
    """An interpreter path or a command name on the remote PATH. It is shell-quoted anyway;
    this refuses what could only be a mistake or an attack."""
    if not python:
        raise HostError("empty remote python")
    if python.startswith("-"):
        raise HostError(f"refusing remote python {python!r}: it starts with '-' and could be read as an option")
    if CONTROL_CHARACTER.search(python):
        raise HostError(f"refusing remote python {python!r}: it contains a control character")
    if "\\" in python:
        raise HostError(f"refusing remote python {python!r}: backslash")
    return python


def parse_host(text: str, *, name: str | None = None, python: str | None = None) -> Host:
    """`[user@]HOST[:PORT]`, `[user@][IPv6]:PORT`, or a bare IPv6 address."""
    raw = text
    check_free_text("host", raw)
    user = None
    if "@" in text:
        user, _, text = text.rpartition("@")
        check_user(user)
    port: int | None = None
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        if not sep:
            raise HostError(f"refusing host {raw!r}: '[' without ']'")
        if rest:
            if not rest.startswith(":"):
                raise HostError(f"refusing host {raw!r}: expected ':PORT' after ']'")
            port = check_port(rest[1:])
        address = inner
    elif text.count(":") == 1:
        address, _, port_text = text.partition(":")
        port = check_port(port_text)
    else:
        address = text  # a host name, or an IPv6 address without port
    check_address(address)
    if name is not None:
        check_free_text("host name", name)
    if python is not None:
        check_remote_python(python)
    return Host(name=name or raw, address=address, user=user, port=port, python=python)
