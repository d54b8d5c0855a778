"""Which hosts a run targets: `--host` (repeatable) and `--inventory FILE|DIR` (repeatable).

Inventories are read by ansible-core's own `ansible-inventory --list` where it is installed
beside patcher or named with `--ansible-inventory PATH` (every format, directories,
group_vars/ host_vars/, scripts and inventory plugins; inventory_ansible.py), else by the
built-in reader, which reads Ansible's INI and YAML formats, plain lists, directories and
group_vars/ host_vars/ as ansible-core does and refuses the rest (inventory_files.py).
`--limit` uses ansible-core's pattern semantics (host_patterns.py) on names and groups.

Connection variables honoured (ansible-core's names; of two spellings the `ansible_ssh_*` one
wins, as there): ansible_host, ansible_port, ansible_user, ansible_private_key_file,
ansible_ssh_common_args and ansible_ssh_extra_args (inventory files only), ansible_python_interpreter,
ansible_become (sudo to root), ansible_connection (ssh). `{{ variable }}` references in them are
resolved; any other Jinja is refused. Other `ansible_*` variables are noted as ignored for the host.
A variable error is raised only for hosts the run keeps (after --limit).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import printable
from .host_address import Host, HostError, check_address, check_port, check_remote_python, check_user, parse_host
from .host_patterns import select
from .inventory_files import Entry, Inventory, InventoryError, read_files

__all__ = ["InventoryError", "hosts_from_options", "load_hosts", "read_inventory"]

RETRY_HEADER = "# patcher retry file: the hosts that did not succeed; rerun with --inventory "

# what patcher reads; the rest of `ansible_*` is reported as ignored
HONOURED = {
    "ansible_host",
    "ansible_ssh_host",
    "ansible_port",
    "ansible_ssh_port",
    "ansible_user",
    "ansible_ssh_user",
    "ansible_private_key_file",
    "ansible_ssh_private_key_file",
    "ansible_ssh_common_args",
    "ansible_ssh_extra_args",
    "ansible_python_interpreter",
    "ansible_become",
    "ansible_sudo",
    "ansible_become_method",
    "ansible_become_user",
    "ansible_connection",
    "ansible_group_priority",
}
_TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass
class Loaded:
    hosts: list[Host]
    readers: list[str]  # which reader read each inventory, in order


# ------------------------------------------------------------------ reading


def read_inventory(path: str | Path, ansible: str | None = None) -> list[Host]:
    """Every host of one inventory (file or directory), connection variables checked."""
    inventory = _read(Path(path), ansible)
    return [connection(e, str(path)) for e in inventory.entries]


def _read(path: Path, ansible: str | None) -> Inventory:
    if ansible:
        from .inventory_ansible import read_with_ansible

        inventory = read_with_ansible(ansible, path)
    else:
        if not path.exists():
            raise InventoryError(f"inventory {path} does not exist")
        inventory = read_files([path])
    if not inventory.entries:
        raise InventoryError(f"inventory {path} lists no host")
    return inventory


RENDERED_LIMIT = 65536  # a connection variable is a name, a path or an option: far below this


def _render(name: str, key: str, value, variables: dict, where: str):
    """`{{ variable }}` references resolved against the host's variables, as Ansible would;
    anything else Jinja does is refused."""
    for _ in range(20):
        if not isinstance(value, str) or "{" not in value:
            return value
        match = _TEMPLATE.search(value)
        if match is None:
            if "{{" in value or "{%" in value:
                raise InventoryError(
                    f"inventory {where}: host {name!r}: {key}={value!r} is a Jinja expression patcher does not "
                    "evaluate (only {{ variable }} references); write the value itself"
                )
            return value
        ref = match.group(1)
        if ref == "inventory_hostname":
            resolved = name
        elif ref in variables:
            resolved = variables[ref]
        else:
            raise InventoryError(
                f"inventory {where}: host {name!r}: {key}={value!r} uses {ref!r}, which is not defined"
            )
        if match.group(0) == value:
            value = resolved
        else:
            value = value[: match.start()] + str(resolved) + value[match.end() :]
        if isinstance(value, str) and len(value) > RENDERED_LIMIT:
            raise InventoryError(
                f"inventory {where}: host {name!r}: {key} renders to over {RENDERED_LIMIT:,} characters "
                "(a template chain multiplies it); write the value itself"
            )
    raise InventoryError(f"inventory {where}: host {name!r}: {key} refers to itself through templates")


_TRUE = ("true", "yes", "on", "1", "y", "t")
_FALSE = ("false", "no", "off", "0", "n", "f")


def _become(variables: dict) -> bool:
    """ansible_become (and its method and user, which must be what patcher does: sudo, root)."""
    value = variables.get("ansible_become", variables.get("ansible_sudo"))
    if value is None:
        return False
    text = str(value).strip().lower()
    if text not in _TRUE + _FALSE:
        raise HostError(f"ansible_become={value} is not a boolean; write true or false")
    if text in _FALSE:
        return False
    method = str(variables.get("ansible_become_method", "sudo"))
    if method != "sudo":
        raise HostError(f"ansible_become_method={method} is not supported (patcher uses `sudo -n`); use sudo")
    user = str(variables.get("ansible_become_user", "root"))
    if user != "root":
        raise HostError(f"ansible_become_user={user} is not supported (patcher's agent runs as root); drop it")
    return True


def _ssh_words(key: str, value: str) -> tuple[str, ...]:
    try:
        words = tuple(shlex.split(value))
    except ValueError as exc:
        raise HostError(f"{key}: {exc}") from None
    for word in words:
        if re.search(r"[\x00-\x1f\x7f]", word):
            raise HostError(f"{key}: a control character in {word!r}")
    if words and not words[0].startswith("-"):
        raise HostError(f"{key}={value!r}: expected ssh options (e.g. -o ProxyJump=bastion)")
    return words


def connection(entry: Entry, where: str) -> Host:
    """The Host that ssh is given for an inventory entry."""
    name, variables = entry.name, entry.variables

    def pick(*keys: str) -> str | None:
        found = None
        for key in keys:  # as ansible-core: of the spellings defined, the last listed wins
            if variables.get(key) is not None:
                found = key
        if found is None:
            return None
        value = _render(name, found, variables[found], variables, where)
        return None if value is None else str(value)

    try:
        connection_type = pick("ansible_connection") or "ssh"
        if connection_type not in ("ssh", "smart", "paramiko", "paramiko_ssh"):
            raise HostError(
                f"ansible_connection={connection_type} is not supported (patcher uses ssh); "
                "for this machine use --python without --host, or leave it out with --limit"
            )
        base = parse_host(name)  # `user@host:port` names (patcher's plain lists) give user and port
        address = pick("ansible_host", "ansible_ssh_host")
        address = check_address(address) if address is not None else base.address
        user = pick("ansible_user", "ansible_ssh_user")
        user = check_user(user) if user is not None else base.user
        port_text = pick("ansible_port", "ansible_ssh_port")
        port = check_port(port_text) if port_text is not None else base.port
        python = pick("ansible_python_interpreter")
        if python is not None and python.startswith("auto"):
            python = None  # Ansible's interpreter discovery: --python decides
        if python is not None:
            check_remote_python(python)
        key_file = pick("ansible_private_key_file", "ansible_ssh_private_key_file")
        if key_file is not None and (not key_file or key_file.startswith("-") or re.search(r"[\x00-\x1f]", key_file)):
            raise HostError(f"refusing ansible_ssh_private_key_file {key_file!r}: a file path")
        ssh_args: tuple[str, ...] = ()
        for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
            value = pick(key)
            if value:
                ssh_args += _ssh_words(key, value)
        become = _become(
            {
                k: _render(name, k, v, variables, where)
                for k, v in variables.items()
                if k.startswith("ansible_") and k in HONOURED
            }
        )
    except HostError as exc:
        raise InventoryError(f"inventory {where}: host {name!r}: {exc}") from None
    ignored = sorted(k for k in variables if k.startswith("ansible_") and k not in HONOURED)
    notes = (f"inventory variables patcher ignores for this host: {', '.join(ignored)}",) if ignored else ()
    return Host(
        name=name,
        address=address,
        user=user,
        port=port,
        python=python,
        become=become,
        key_file=key_file,
        ssh_args=ssh_args,
        groups=entry.groups,
        notes=notes,
    )


# ------------------------------------------------------------------ --host and the retry file


def find_ansible_inventory(explicit: str | None, disabled: bool = False) -> str | None:
    """The `ansible-inventory` to read inventories with: the one named, else the one installed
    beside patcher (same bin folder as this interpreter), else None (the built-in reader)."""
    import os
    import sys

    if disabled:
        return None
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise InventoryError(
                f"--ansible-inventory {explicit}: no executable there; name ansible-core's ansible-inventory"
            )
        return str(path)
    beside = Path(sys.executable).parent / "ansible-inventory"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def load_hosts(
    specs: Iterable[str], inventories: Iterable[str], limit: str | None = None, ansible: str | None = None
) -> Loaded:
    """Every host of the run, in order: --host ones first, then the inventories' (read together,
    as Ansible reads several -i), --limit applied, then each kept host's variables checked."""
    specs, inventories = list(specs), list(inventories)
    entries = [Entry(spec, {}, ("all", "ungrouped")) for spec in specs]
    for spec in specs:
        parse_host(spec)  # a bad --host is refused before any inventory is read
    readers: list[str] = []
    group_hosts: dict[str, list[str]] = {"all": [], "ungrouped": []}
    where = ", ".join(inventories)
    if inventories:
        paths = [Path(i) for i in inventories]
        if ansible:
            from .inventory_ansible import read_with_ansible

            inventory = read_with_ansible(ansible, *paths)
        else:
            for path in paths:
                if not path.exists():
                    raise InventoryError(f"inventory {path} does not exist")
            inventory = read_files(paths)
        if not inventory.entries:
            raise InventoryError(f"inventory {where} lists no host")
        readers.append(inventory.reader)
        known = {e.name for e in entries}
        entries += [e for e in inventory.entries if e.name not in known]
        group_hosts = {g: list(h) for g, h in inventory.group_hosts.items()}
        group_hosts.setdefault("all", [])
        group_hosts.setdefault("ungrouped", [])
    for group in ("all", "ungrouped"):
        group_hosts[group] = [*specs, *(h for h in group_hosts[group] if h not in specs)]
    combined = Inventory(entries, group_hosts, readers[0] if readers else "")
    kept = select(combined, limit) if limit is not None else combined.entries
    hosts = [parse_host(e.name) if e.name in specs else connection(e, where) for e in kept]
    return Loaded(hosts, readers)


def hosts_from_options(specs: Iterable[str], inventories: Iterable[str]) -> list[Host]:
    """Every host of --host and the inventories (built-in reader), in order."""
    return load_hosts(specs, inventories).hosts


def inventory_line(host: Host) -> str:
    """The host as one line of a plain-list/INI inventory that reads back as the same Host."""
    words = [host.name]
    base = parse_host(host.name)
    if host.address != base.address:
        words.append(f"ansible_host={host.address}")
    if host.user != base.user and host.user:
        words.append(f"ansible_user={host.user}")
    if host.port != base.port and host.port:
        words.append(f"ansible_port={host.port}")
    if host.python:
        words.append(f"ansible_python_interpreter={shlex.quote(host.python)}")
    if host.become:
        words.append("ansible_become=true")
    if host.key_file:
        words.append(f"ansible_ssh_private_key_file={shlex.quote(host.key_file)}")
    if host.ssh_args:
        words.append(f"ansible_ssh_common_args={shlex.quote(shlex.join(host.ssh_args))}")
    return " ".join(words)


def check_retry_file(path: str | Path, inventories: Iterable[str] = (), limited: bool = False) -> None:
    """Refuse (exit 2) a retry file patcher may not write: one that exists and is not a retry
    file patcher wrote (its first line is RETRY_HEADER), a link, or (with --limit) an inventory
    of this run, which a rewrite would cut down to the hosts the limit kept."""
    import os

    path = Path(path)
    if path.is_symlink():
        raise InventoryError(
            f"the retry file {path} is a symbolic link; name the file itself with --retry-file, or pass --no-retry-file"
        )
    if path.exists() and not is_retry_file(path):
        raise InventoryError(
            f"the retry file {path} exists and patcher did not write it (its first line is not patcher's "
            "marker); name a new file with --retry-file, move it aside, or pass --no-retry-file"
        )
    if limited and path.exists():
        for inventory in inventories:
            try:
                same = os.path.samefile(inventory, path)
            except OSError:
                same = False
            if same:
                raise InventoryError(
                    f"the retry file {path} is also this run's inventory and --limit runs only part of it: "
                    "rewriting it would drop the hosts left out; name another --retry-file or pass --no-retry-file"
                )


def write_retry_file(path: str | Path, command: str, hosts: list[tuple[Host, str]]) -> None:
    """`hosts`: (host, why it did not succeed). Written as patcher's output files are
    (patcher.output_files), over nothing but a new name or a retry file patcher wrote
    (check_retry_file; InventoryError otherwise)."""
    from ..output_files import write_output_file

    check_retry_file(path)
    path = Path(path)
    lines = [RETRY_HEADER + str(path), f"# command: patcher {command}"]
    for host, why in hosts:
        # A target's words, escaped: no character of theirs may end the comment and start an inventory line.
        lines.append(printable(f"# {why}")[:300])
        lines.append(inventory_line(host))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    write_output_file(path, data)


def is_retry_file(path: str | Path) -> bool:
    """A regular file (not a link) whose first line is patcher's marker."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a fifo...
        os.close(fd)
        return False
    with os.fdopen(fd, "rb") as fh:
        return fh.readline(4096).decode("utf-8", "replace").startswith(RETRY_HEADER)
