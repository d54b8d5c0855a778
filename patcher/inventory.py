"""Which hosts a run targets: `--host` (repeatable) and `--inventory FILE`.

An inventory is one of
- a plain list: one `[user@]HOST[:PORT]` per line, `#` comments, optionally followed by
  `key=value` variables (that is an Ansible INI inventory without sections);
- the common subset of an Ansible INI inventory: `[group]`, `[group:vars]`, `[group:children]`,
  host lines with variables, numeric ranges (`gpu[01:32].example`);
- the common subset of an Ansible YAML inventory (`.yml`/`.yaml`, or a file whose first line is
  `name:`): groups with `hosts`, `vars` and `children`, nested to any depth under `all`.

Variables read: `ansible_host`, `ansible_user`, `ansible_port`, `ansible_python_interpreter`
(and the older `ansible_ssh_host/_user/_port`), `ansible_become` (the host is run through
`sudo -n`, as `--sudo` does; `ansible_become_method` must be sudo and `ansible_become_user` root). Host variables win over group variables, a
child group's over its parent's, and `all`'s come last, as in Ansible. Others are ignored.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .ssh import Host, HostError, check_address, check_port, check_remote_python, check_user, parse_host

RETRY_HEADER = "# patcher retry file: the hosts that did not succeed; rerun with --inventory "

_RANGE = re.compile(r"\[(\d+):(\d+)\]")
_SECTION = re.compile(r"^\[([^\]]+)\]\s*$")


class InventoryError(ValueError):
    """An inventory that cannot be read as one of the supported formats: exit 2."""


@dataclass
class _Group:
    name: str
    hosts: list[str] = field(default_factory=list)
    vars: dict = field(default_factory=dict)
    children: list[str] = field(default_factory=list)


@dataclass
class _Tree:
    groups: dict[str, _Group] = field(default_factory=dict)
    host_vars: dict[str, dict] = field(default_factory=dict)  # name -> its own variables
    order: list[str] = field(default_factory=list)

    def group(self, name: str) -> _Group:
        return self.groups.setdefault(name, _Group(name))

    def add_host(self, group: str, name: str, variables: dict) -> None:
        if name not in self.host_vars:
            self.host_vars[name] = {}
            self.order.append(name)
        self.host_vars[name].update(variables)
        if name not in self.group(group).hosts:
            self.group(group).hosts.append(name)


# ------------------------------------------------------------------ reading


def read_inventory(path: str | Path) -> list[Host]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"inventory {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read inventory {path}: {exc}") from None
    tree = _read_yaml(text, path) if _looks_like_yaml(text, path) else _read_ini(text, path)
    hosts = _resolve(tree, path)
    if not hosts:
        raise InventoryError(f"inventory {path} lists no host")
    return hosts


def _looks_like_yaml(text: str, path: Path) -> bool:
    if path.suffix.lower() in (".yml", ".yaml"):
        return True
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        return stripped == "---" or bool(re.fullmatch(r"[A-Za-z0-9_.-]+:\s*(#.*)?", stripped))
    return False


def _expand(pattern: str) -> list[str]:
    """`gpu[01:03]` -> gpu01, gpu02, gpu03 (Ansible's numeric ranges; zero padding kept)."""
    match = _RANGE.search(pattern)
    if not match or pattern.startswith("["):  # `[v6]:port` is an address, not a range
        return [pattern]
    start, end = match.group(1), match.group(2)
    if int(end) < int(start):
        raise InventoryError(f"host range {pattern!r} runs backwards")
    width = len(start) if start.startswith("0") else 0
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [n for i in range(int(start), int(end) + 1) for n in _expand(f"{head}{str(i).zfill(width)}{tail}")]


def _read_ini(text: str, path: Path) -> _Tree:
    tree = _Tree()
    tree.group("all")
    section, kind = "ungrouped", "hosts"
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{number}"
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        header = _SECTION.match(stripped)
        if header and not re.fullmatch(r"\[[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*\](:\d+)?", stripped.split()[0]):
            section, _, kind = header.group(1).partition(":")
            kind = kind or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise InventoryError(f"{where}: unknown section kind {kind!r} (hosts, vars or children)")
            tree.group(section)
            continue
        try:
            words = shlex.split(stripped, comments=True)
        except ValueError as exc:
            raise InventoryError(f"{where}: {exc}") from None
        if not words:
            continue
        if kind == "vars":
            key, sep, value = stripped.partition("=")
            if not sep:
                raise InventoryError(f"{where}: expected key=value in [{section}:vars]")
            tree.group(section).vars[key.strip()] = _unquote(value.strip())
        elif kind == "children":
            tree.group(words[0])
            if words[0] not in tree.group(section).children:
                tree.group(section).children.append(words[0])
        else:
            variables = {}
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if not sep:
                    raise InventoryError(f"{where}: expected key=value after the host name, got {word!r}")
                variables[key] = value
            for name in _expand(words[0]):
                tree.add_host(section, name, variables)
    return tree


def _unquote(value: str) -> str:
    try:
        words = shlex.split(value, comments=True)
    except ValueError:
        return value
    return words[0] if len(words) == 1 else value


def _read_yaml(text: str, path: Path) -> _Tree:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InventoryError(f"inventory {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"inventory {path}: expected a mapping of groups at the top (e.g. `all:`)")
    tree = _Tree()
    tree.group("all")

    def visit(name: str, body, trail: tuple[str, ...]) -> None:
        if name in trail:
            raise InventoryError(f"inventory {path}: group {name!r} contains itself")
        group = tree.group(str(name))
        if body is None:
            return
        if not isinstance(body, dict):
            raise InventoryError(f"inventory {path}: group {name!r} must be a mapping (hosts, vars, children)")
        unknown = set(body) - {"hosts", "vars", "children"}
        if unknown:
            raise InventoryError(f"inventory {path}: group {name!r} has {sorted(unknown)}; expected hosts, vars, children")
        hosts = body.get("hosts") or {}
        if isinstance(hosts, list):  # a list of names is a common slip; accept it
            hosts = {h: None for h in hosts}
        if not isinstance(hosts, dict):
            raise InventoryError(f"inventory {path}: hosts of group {name!r} must be a mapping")
        for host, variables in hosts.items():
            if variables is not None and not isinstance(variables, dict):
                raise InventoryError(f"inventory {path}: variables of host {host!r} must be a mapping")
            for expanded in _expand(str(host)):
                tree.add_host(group.name, expanded, {k: v for k, v in (variables or {}).items()})
        variables = body.get("vars") or {}
        if not isinstance(variables, dict):
            raise InventoryError(f"inventory {path}: vars of group {name!r} must be a mapping")
        group.vars.update(variables)
        children = body.get("children") or {}
        if isinstance(children, list):
            children = {c: None for c in children}
        for child, child_body in children.items():
            if str(child) not in group.children:
                group.children.append(str(child))
            visit(str(child), child_body, trail + (name,))

    for name, body in data.items():
        visit(str(name), body, ())
    return tree


# ------------------------------------------------------------------ variables -> hosts


def _resolve(tree: _Tree, path: Path) -> list[Host]:
    depth: dict[str, int] = {}

    def walk(name: str, level: int, trail: tuple[str, ...]) -> None:
        if name in trail:
            raise InventoryError(f"inventory {path}: group {name!r} contains itself")
        depth[name] = max(depth.get(name, 0), level)
        for child in tree.groups.get(name, _Group(name)).children:
            walk(child, level + 1, trail + (name,))

    for top in tree.groups:
        if top not in depth:
            walk(top, 1 if top != "all" else 0, ())
    member: dict[str, set[str]] = {name: set() for name in tree.order}

    def collect(group: str, seen: set[str]) -> set[str]:
        if group in seen:
            return set()
        seen.add(group)
        g = tree.groups.get(group, _Group(group))
        found = set(g.hosts)
        for child in g.children:
            found |= collect(child, seen)
        return found

    for group in tree.groups:
        for host in collect(group, set()):
            member.setdefault(host, set()).add(group)

    hosts = []
    for name in tree.order:
        merged: dict = dict(tree.groups["all"].vars)
        for group in sorted(member[name] - {"all"}, key=lambda g: (depth.get(g, 1), g)):
            merged.update(tree.groups[group].vars)
        merged.update(tree.host_vars[name])
        hosts.append(_host(name, merged, path, tuple(sorted(member[name] | {"all"}))))
    return hosts


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


def _host(name: str, variables: dict, path: Path, groups: tuple[str, ...] = ()) -> Host:
    def pick(*keys: str) -> str | None:
        for key in keys:
            if variables.get(key) is not None:
                return str(variables[key])
        return None

    known = {
        k: v
        for k, v in {
            "host": pick("ansible_host", "ansible_ssh_host"),
            "user": pick("ansible_user", "ansible_ssh_user"),
            "port": pick("ansible_port", "ansible_ssh_port"),
            "python": pick("ansible_python_interpreter"),
        }.items()
        if v is not None
    }
    connection = str(variables.get("ansible_connection", "ssh"))
    try:
        if connection not in ("ssh", "smart", "paramiko", "paramiko_ssh"):
            raise HostError(
                f"ansible_connection={connection} is not supported (patcher uses ssh); "
                "for this machine use --python without --host"
            )
        base = parse_host(name)
        address = check_address(known["host"]) if "host" in known else base.address
        user = check_user(known["user"]) if "user" in known else base.user
        port = check_port(known["port"]) if "port" in known else base.port
        python = known.get("python")
        if python is not None and (python.startswith("auto") or python.startswith("{{")):
            python = None  # Ansible's interpreter discovery or a template: let --python decide
        if python is not None:
            check_remote_python(python)
        become = _become(variables)
    except HostError as exc:
        raise InventoryError(f"inventory {path}: host {name!r}: {exc}") from None
    return Host(name=name, address=address, user=user, port=port, python=python, become=become, groups=groups)


# ------------------------------------------------------------------ --host and the retry file


def hosts_from_options(specs: Iterable[str], inventories: Iterable[str]) -> list[Host]:
    """Every host of the run, in order: --host ones first, then each inventory's; duplicates
    (same name and interpreter) once."""
    hosts: list[Host] = [parse_host(spec) for spec in specs]
    for inventory in inventories:
        hosts.extend(read_inventory(inventory))
    unique: list[Host] = []
    seen = set()
    for host in hosts:
        key = (host.name, host.address, host.user, host.port, host.python, host.become)
        if key not in seen:
            seen.add(key)
            unique.append(host)
    return unique


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
    return " ".join(words)


def limit_hosts(hosts: list[Host], pattern: str) -> list[Host]:
    """The hosts `--limit PATTERN` keeps, as Ansible reads it: comma-separated terms, each a host
    name, an address or a group name, shell wildcards allowed (`gpu-*`); `!term` drops the hosts
    it matches, `&term` keeps only hosts that also match it; without plain terms, every host is
    the start. A plain term that matches nothing is a mistake (a typo would skip hosts silently)."""
    import fnmatch

    terms = [t.strip() for t in pattern.split(",") if t.strip()]
    if not terms:
        raise InventoryError("--limit needs a pattern: host or group names, comma-separated")

    def matches(host: Host, term: str) -> bool:
        return any(fnmatch.fnmatchcase(name, term) for name in (host.name, host.address, *host.groups))

    plain = [t for t in terms if t[0] not in "!&"]
    for term in plain:
        if not any(matches(h, term) for h in hosts):
            groups = sorted({g for h in hosts for g in h.groups} - {"all"})
            known = f"; groups: {', '.join(groups)}" if groups else ""
            raise InventoryError(f"--limit: {term!r} matches no host or group{known}; check the name")
    kept = [h for h in hosts if any(matches(h, t) for t in plain)] if plain else list(hosts)
    for term in terms:
        if term.startswith("&"):
            kept = [h for h in kept if matches(h, term[1:])]
        elif term.startswith("!"):
            kept = [h for h in kept if not matches(h, term[1:])]
    if not kept:
        raise InventoryError(f"--limit {pattern!r} leaves no host to run on")
    return kept


def check_retry_file(path: str | Path, inventories: Iterable[str] = (), limited: bool = False) -> None:
    """Refuse (exit 2) a --retry-file patcher may not write: one that exists and is not a retry
    file patcher wrote (its first line is RETRY_HEADER), a link, or (with --limit) an inventory
    of this run, which a rewrite would cut down to the hosts the limit kept."""
    import os

    path = Path(path)
    if path.is_symlink():
        raise InventoryError(f"--retry-file {path} is a symbolic link; name the file itself, or pass --no-retry-file")
    if path.exists() and not is_retry_file(path):
        raise InventoryError(
            f"--retry-file {path} exists and patcher did not write it (its first line is not patcher's "
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
                    f"--retry-file {path} is also this run's inventory and --limit runs only part of it: "
                    "rewriting it would drop the hosts left out; name another --retry-file or pass --no-retry-file"
                )


def write_retry_file(path: str | Path, command: str, hosts: list[tuple[Host, str]]) -> None:
    """`hosts`: (host, why it did not succeed). Written atomically, over nothing but a new name
    or a retry file patcher wrote (check_retry_file; InventoryError otherwise)."""
    import os

    check_retry_file(path)
    path = Path(path)
    lines = [RETRY_HEADER + str(path), f"# command: patcher {command}"]
    for host, why in hosts:
        lines.append(f"# {why}".replace("\n", " ")[:300])
        lines.append(inventory_line(host))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    while True:  # a new temporary, never through a link someone left at a known name
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
