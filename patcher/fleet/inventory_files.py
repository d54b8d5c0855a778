"""The built-in inventory reader: Ansible's INI and YAML inventories, plain host lists, directories
of them, and group_vars/ host_vars/ beside them, read as ansible-core reads them (checked against
`ansible-inventory --list` by tests/test_inventory_corpus.py). What it cannot read as Ansible
would (an executable inventory script, an inventory plugin's YAML such as `plugin: aws_ec2`) is
refused with the reason: those need ansible-core (see inventory_ansible.py).

The result is a list of `Entry`: a host's name, its variables merged with Ansible's precedence
(inventory group vars by depth, group_vars/all, group_vars/<group> by depth, the host's own
inventory vars, host_vars/<host>), and its groups; plus each group's hosts in Ansible's order
(for `--limit web[0]`).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import string
from dataclasses import dataclass, field
from pathlib import Path


class InventoryError(ValueError):
    """An inventory that cannot be read as one of the supported formats: exit 2."""


NEEDS_ANSIBLE = "install ansible-core beside patcher (pip install ansible-core) or name its ansible-inventory with --ansible-inventory"


@dataclass
class Entry:
    """One host as the inventory has it, before its connection variables are checked."""

    name: str
    variables: dict
    groups: tuple[str, ...]  # every group it belongs to, `all` included, sorted


@dataclass
class Inventory:
    entries: list[Entry]  # in Ansible's order (that of the `all` group)
    group_hosts: dict[str, list[str]]  # group -> its hosts (children's included) in Ansible's order
    reader: str  # "built-in" or "ansible-inventory X.Y.Z (PATH)"


# ------------------------------------------------------------------ limits on what an inventory expands to

DEPTH_VARIABLE = "PATCHER_INVENTORY_MAX_DEPTH"
NODES_VARIABLE = "PATCHER_INVENTORY_MAX_NODES"


def limit_from_environment(variable: str, default: int) -> int:
    """A positive whole number from the environment (the default when unset or not a number)."""
    try:
        return max(1, int(os.environ.get(variable, default)))
    except ValueError:
        return default


def max_group_depth() -> int:
    return limit_from_environment(DEPTH_VARIABLE, 100)


def max_nodes() -> int:
    """Values (mappings, lists, scalars) a YAML inventory may expand to once its aliases are
    followed: a 100,000-host inventory is well under it, a billion-laughs chain far over."""
    return limit_from_environment(NODES_VARIABLE, 5_000_000)


def check_expanded_size(data, where: str) -> None:
    """Refuse YAML whose aliases multiply it past max_nodes(), counted without expanding it:
    each distinct mapping or list is sized once (aliases share objects)."""
    limit = max_nodes()
    size: dict[int, int] = {}
    todo: list[tuple[object, bool]] = [(data, False)]
    while todo:
        value, children_done = todo.pop()
        if not isinstance(value, (dict, list)) or (id(value) in size and not children_done):
            continue
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        if not children_done:
            todo.append((value, True))
            todo.extend((item, False) for item in items if isinstance(item, (dict, list)) and id(item) not in size)
            continue
        size[id(value)] = 1 + sum(size.get(id(item), 1) for item in items)
        if size[id(value)] > limit:
            raise InventoryError(
                f"{where}: the inventory expands to over {limit:,} values (YAML aliases multiply it); "
                f"the limit is {limit:,} ({NODES_VARIABLE} raises it)"
            )


# ------------------------------------------------------------------ the tree of groups


@dataclass
class _Group:
    name: str
    hosts: list[str] = field(default_factory=list)
    vars: dict = field(default_factory=dict)
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    host_set: set[str] = field(default_factory=set)  # `hosts` as a set: membership in constant time


@dataclass
class _Tree:
    groups: dict[str, _Group] = field(default_factory=dict)
    host_vars: dict[str, dict] = field(default_factory=dict)  # name -> its own inventory variables

    def __post_init__(self) -> None:
        self.group("all")
        self.group("ungrouped")
        self.add_child("all", "ungrouped")

    def group(self, name: str) -> _Group:
        found = self.groups.get(name)
        if found is None:  # made only when new: this is called for every ancestor of every link
            found = self.groups[name] = _Group(name)
        return found

    def add_child(self, parent: str, child: str, where: str = "") -> None:
        # a cycle iff the parent is already below the child: searched downwards, which costs
        # nothing for the usual top-down definitions (the child has no children yet)
        if child == parent or parent in self._below(child):
            raise InventoryError(f"{where or 'inventory'}: group {child!r} would contain itself")
        if child not in self.group(parent).children:
            self.group(parent).children.append(child)
            self.group(child).parents.append(parent)

    def _below(self, name: str) -> set[str]:
        found: set[str] = set()
        todo = list(self.group(name).children)
        while todo:
            g = todo.pop()
            if g not in found:
                found.add(g)
                todo.extend(self.group(g).children)
        return found

    def add_host(self, group: str, name: str, port: int | None, variables: dict) -> None:
        own = self.host_vars.setdefault(name, {})
        if port is not None:
            own["ansible_port"] = port  # as Ansible: a `host:port` is the host's own ansible_port
        own.update(variables)
        members = self.group(group)
        if name not in members.host_set:
            members.host_set.add(name)
            members.hosts.append(name)

    def reconcile(self) -> None:
        """As ansible-core: top-level groups become children of `all`; a host in a named group
        is not in `ungrouped`."""
        for name in list(self.groups):
            if name != "all" and not self.group(name).parents:
                self.add_child("all", name)
        named = {h for g in self.groups.values() if g.name not in ("all", "ungrouped") for h in g.hosts}
        ungrouped = self.group("ungrouped")
        ungrouped.hosts = [h for h in ungrouped.hosts if h not in named]
        ungrouped.host_set = set(ungrouped.hosts)
        for h in self.group("all").hosts:
            if h not in named and h not in ungrouped.host_set:
                ungrouped.host_set.add(h)
                ungrouped.hosts.append(h)

    def descendants(self, name: str) -> list[str]:
        """ansible-core's order: the group, its children, then each further generation."""
        ordered = [name, *self.group(name).children]
        seen = set(ordered)
        level = list(self.group(name).children)
        while level:
            nxt = []
            for g in level:
                for child in self.group(g).children:
                    if child not in seen:
                        seen.add(child)
                        ordered.append(child)
                        nxt.append(child)
            level = nxt
        return ordered

    def hosts_of(self, name: str) -> list[str]:
        hosts: list[str] = []
        seen: set[str] = set()
        for g in self.descendants(name):
            for h in self.group(g).hosts:
                if h not in seen:
                    seen.add(h)
                    hosts.append(h)
        return hosts

    def depths(self) -> dict[str, int]:
        """Each group's depth below `all` (its longest path of parents), without recursion: a
        group nested thousands deep is refused with the limit, never a RecursionError."""
        depth = {"all": 0}
        for start in self.groups:
            todo = [start]
            while todo:
                name = todo[-1]
                if name in depth:
                    todo.pop()
                    continue
                parents = [p for p in self.group(name).parents if p not in depth]
                if parents:
                    todo.extend(parents)
                    continue
                todo.pop()
                depth[name] = 1 + max((depth[p] for p in self.group(name).parents), default=0)
                if depth[name] > max_group_depth():
                    raise InventoryError(
                        f"inventory: group {name!r} is nested {depth[name]} groups deep, over the limit of "
                        f"{max_group_depth()} ({DEPTH_VARIABLE} raises it)"
                    )
        return depth


# ------------------------------------------------------------------ host patterns and ranges

_RANGE = r"\[(?:[a-z]:[a-z]|[0-9]+:[0-9]+)(?::[0-9]+)?\]"
_LABEL = rf"(?:[\w]|{_RANGE})(?:[\w_-]|{_RANGE})*(?<![_-])"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$", re.IGNORECASE)
_BRACKETED_PORT = re.compile(r"^\[(.+)\]:([0-9]+)$")
_HOST_PORT = re.compile(r"^((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)$")


def _is_address(text: str) -> bool:
    import ipaddress

    if _HOSTNAME.match(text):
        return True
    try:
        ipaddress.IPv6Address(re.sub(r"\[[0-9a-f]+:[0-9a-f]+(:[0-9]+)?\]", "0", text, flags=re.IGNORECASE))
        return True
    except ValueError:
        return False


def parse_address(pattern: str) -> tuple[str, int | None] | None:
    """ansible-core's parse_address (ranges allowed): (host, port) or None when not an address."""
    port = None
    address = pattern
    for regex in (_BRACKETED_PORT, _HOST_PORT):
        m = regex.match(address)
        if m:
            address, port = m.group(1), int(m.group(2))
    return (address, port) if _is_address(address) else None


def split_port(pattern: str) -> tuple[str, int | None]:
    """`web2:2242` -> (web2, 2242); a token that is not an address (`root@web2:22`) is a name as
    it is, without a port (patcher reads user and port out of such a name later)."""
    return parse_address(pattern) or (pattern, None)


def expand(pattern: str, where: str) -> list[str]:
    """`gpu[01:03]`, `node[a:c]`, `w[1:9:2]`: ansible-core's host ranges (padding kept)."""
    if "[" not in pattern:
        return [pattern]
    head, _, rest = pattern.partition("[")
    body, close, tail = rest.partition("]")
    bounds = body.split(":")
    if not close or len(bounds) not in (2, 3):
        raise InventoryError(
            f"{where}: host range {pattern!r} must be [begin:end] or [begin:end:step], e.g. gpu[01:32]"
        )
    begin, end = bounds[0] or "0", bounds[1]
    step_text = bounds[2] if len(bounds) == 3 else "1"
    if not end or not step_text.isdigit() or int(step_text) < 1:
        raise InventoryError(f"{where}: host range {pattern!r} needs an end and a positive step, e.g. w[1:9:2]")
    step = int(step_text)
    width = len(begin) if begin.startswith("0") and len(begin) > 1 else 0
    if width and len(end) != width:
        raise InventoryError(f"{where}: host range {pattern!r}: write begin and end with the same width (01:32)")
    letters = string.ascii_letters
    if begin in letters and end in letters and len(begin) == len(end) == 1:
        if letters.index(begin) > letters.index(end):
            raise InventoryError(f"{where}: host range {pattern!r} runs backwards")
        items = list(letters[letters.index(begin) : letters.index(end) + 1 : step])
    elif begin.isdigit() and end.isdigit():
        if int(end) < int(begin):
            raise InventoryError(f"{where}: host range {pattern!r} runs backwards")
        items = [str(i).zfill(width) for i in range(int(begin), int(end) + 1, step)]
    else:
        raise InventoryError(f"{where}: host range {pattern!r}: bounds are numbers or single letters, e.g. node[a:f]")
    return [name for item in items for name in expand(f"{head}{item}{tail}", where)]


# ------------------------------------------------------------------ INI

_SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:#.*)?$")
_GROUP_NAME = re.compile(r"^([^:\]\s]+)\s*(?:#.*)?$")


def _ini_value(text: str):
    """As ansible-core's INI reader: a Python literal when it is one (`22`, `'x'`), else the text."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return value if isinstance(value, (str, int, float, bool, list, dict)) or value is None else text


def _strip_comment(value: str) -> str:
    """patcher drops an inline ` # comment` after an unquoted [group:vars] value (ansible-core keeps
    it in the value: `ansible_user=admin  # ops` is the user `admin  # ops` there, which no ssh
    server has): a deliberate difference."""
    if value[:1] in ("'", '"'):
        return value
    return re.sub(r"\s+#.*$", "", value)


def read_ini(text: str, where: str, tree: _Tree) -> None:
    section, kind = "ungrouped", "hosts"
    pending_children: dict[str, list[str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        here = f"{where}:{number}"
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        header = _SECTION.match(stripped)
        if header:
            section, kind = header.group(1), header.group(2) or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise InventoryError(f"{here}: unknown section kind {kind!r} (hosts, vars or children)")
            if section not in tree.groups and kind == "vars":
                pending_children.setdefault(section, [])
            tree.group(section)
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            raise InventoryError(f"{here}: {stripped!r} is not a section header: no spaces or ':' inside, e.g. [gpus]")
        if kind == "vars":
            key, sep, value = stripped.partition("=")
            if not sep:
                raise InventoryError(f"{here}: expected key=value in [{section}:vars]")
            tree.group(section).vars[key.strip()] = _ini_value(_strip_comment(value.strip()))
        elif kind == "children":
            m = _GROUP_NAME.match(stripped)
            if not m:
                raise InventoryError(f"{here}: expected a group name in [{section}:children]")
            tree.add_child(section, m.group(1), here)
        else:
            try:
                # shlex is the rule; a line with nothing it treats specially splits on whitespace alike,
                # at a fraction of the cost (a 100,000-host inventory is 100,000 such lines)
                plain = not any(c in stripped for c in "\"'\\#")
                words = stripped.split() if plain else shlex.split(stripped, comments=True)
            except ValueError as exc:
                raise InventoryError(f"{here}: {exc}") from None
            if not words:
                continue
            pattern, port = split_port(words[0])
            if words[0].endswith(":") and port is None:
                raise InventoryError(f"{here}: host {words[0]!r} ends in ':' (a port goes after it: host:2222)")
            variables = {}
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if not sep:
                    raise InventoryError(f"{here}: expected key=value after the host name, got {word!r}")
                variables[key] = _ini_value(value)
            for name in expand(pattern, here):
                tree.add_host(section, name, port, variables)


# ------------------------------------------------------------------ YAML


def read_yaml(data, where: str, tree: _Tree) -> None:
    if not isinstance(data, dict):
        raise InventoryError(f"{where}: expected a mapping of groups at the top (e.g. `all:`)")
    if "plugin" in data:
        raise InventoryError(
            f"{where}: an inventory plugin's configuration (plugin: {data['plugin']}) needs ansible-core to run it; "
            + NEEDS_ANSIBLE
        )

    def visit(name: str, body, parent: str | None, trail: tuple[str, ...]) -> None:
        if name in trail:
            raise InventoryError(f"{where}: group {name!r} contains itself")
        if len(trail) >= max_group_depth():
            raise InventoryError(
                f"{where}: group {name!r} is nested {len(trail) + 1} groups deep, over the limit of "
                f"{max_group_depth()} ({DEPTH_VARIABLE} raises it)"
            )
        tree.group(name)
        if parent is not None:
            tree.add_child(parent, name, where)
        if body is None:
            return
        if not isinstance(body, dict):
            raise InventoryError(f"{where}: group {name!r} must be a mapping (hosts, vars, children), not {body!r}")
        unknown = set(body) - {"hosts", "vars", "children"}
        if unknown:
            raise InventoryError(
                f"{where}: group {name!r} has {sorted(map(str, unknown))}; expected hosts, vars, children"
            )
        hosts = body.get("hosts") or {}
        if not isinstance(hosts, dict):
            raise InventoryError(f"{where}: hosts of group {name!r} must be a mapping (host: its variables)")
        for host, variables in hosts.items():
            if variables is not None and not isinstance(variables, dict):
                raise InventoryError(f"{where}: variables of host {host!r} must be a mapping")
            pattern, port = split_port(str(host))
            for expanded in expand(pattern, where):
                tree.add_host(name, expanded, port, dict(variables or {}))
        variables = body.get("vars") or {}
        if not isinstance(variables, dict):
            raise InventoryError(f"{where}: vars of group {name!r} must be a mapping")
        tree.group(name).vars.update(variables)
        children = body.get("children") or {}
        if not isinstance(children, dict):
            raise InventoryError(f"{where}: children of group {name!r} must be a mapping (group: its body)")
        for child, child_body in children.items():
            visit(str(child), child_body, name, trail + (name,))

    for name, body in data.items():
        visit(str(name), body, None, ())


# ------------------------------------------------------------------ files, directories, vars files

# ansible-core skips these in an inventory directory (INVENTORY_IGNORE_EXTS and its fixed names)
_IGNORED = re.compile(
    r"^\.|^host_vars$|^group_vars$|^vars_plugins$|(\.pyc|\.pyo|\.swp|\.bak|~|\.rpm|\.md|\.txt|\.rst|\.orig|\.cfg|\.retry)$"
)
_YAML_EXTS = ("", ".yml", ".yaml", ".json")


def _load_yaml(path: Path):
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise InventoryError(f"{path} nests too deeply to read (over Python's recursion limit): flatten it") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read {path}: {exc}") from None
    check_expanded_size(data, str(path))
    return data


def _read_source(path: Path, tree: _Tree) -> None:
    if path.is_dir():
        for child in sorted(path.iterdir()):
            if not _IGNORED.search(child.name):
                _read_source(child, tree)
        return
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InventoryError(f"inventory {path} does not exist") from None
    except OSError as exc:
        raise InventoryError(f"cannot read inventory {path}: {exc.strerror}") from None
    if os.access(path, os.X_OK) and raw.startswith(b"#!"):
        raise InventoryError(
            f"inventory {path} is an executable script: running it needs ansible-core; " + NEEDS_ANSIBLE
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InventoryError(f"inventory {path} is not UTF-8 text") from None
    suffix = path.suffix.lower()
    if suffix in _YAML_EXTS:
        # as ansible-core: the YAML reader first for these names, INI when the text is not a YAML mapping
        import yaml

        try:
            data = yaml.safe_load(text)
        except RecursionError:
            raise InventoryError(
                f"inventory {path} nests its groups too deeply to read (over Python's recursion limit): flatten it"
            ) from None
        except yaml.YAMLError as exc:
            if suffix:
                raise InventoryError(f"inventory {path} is not valid YAML: {' '.join(str(exc).split())}") from None
            data = None
        if isinstance(data, dict):
            check_expanded_size(data, str(path))
            read_yaml(data, str(path), tree)
            return
        if suffix:
            raise InventoryError(f"inventory {path}: expected a mapping of groups at the top (e.g. `all:`)")
    elif suffix == ".toml":
        raise InventoryError(f"inventory {path}: TOML inventories need ansible-core; " + NEEDS_ANSIBLE)
    read_ini(text, str(path), tree)


def _vars_files(folder: Path, name: str) -> list[Path]:
    """ansible-core's find_vars_files: NAME, NAME.yml, NAME.yaml or NAME.json (the first that
    exists); a directory: every file in it (sorted, recursively) without a suffix or with one of those."""
    for ext in _YAML_EXTS:
        path = folder / f"{name}{ext}"
        if path.is_dir():
            return _dir_files(path)
        if path.exists():
            return [path]
    return []


def _dir_files(folder: Path) -> list[Path]:
    found = []
    for child in sorted(folder.iterdir(), key=lambda p: p.name):
        if child.name.startswith(".") or child.name.endswith("~"):
            continue
        if child.is_dir() and not child.suffix:
            found += _dir_files(child)
        elif child.is_file() and child.suffix in _YAML_EXTS:
            found.append(child)
    return found


def _vars_from(folders: list[Path], kind: str, name: str) -> dict:
    merged: dict = {}
    for folder in folders:
        for path in _vars_files(folder / kind, name):
            data = _load_yaml(path)
            if data is None:
                continue
            if not isinstance(data, dict):
                raise InventoryError(f"{path}: expected a mapping of variables")
            merged.update(data)
    return merged


class _VarsFiles:
    """_vars_from, with each group_vars/ and host_vars/ folder listed once: a 100,000-host
    inventory costs one listing, not a stat per host and possible name."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders
        self.names: dict[str, set[str]] = {}
        for kind in ("group_vars", "host_vars"):
            found: set[str] = set()
            for folder in folders:
                try:
                    found.update(os.listdir(folder / kind))
                except OSError:
                    pass
            self.names[kind] = found
        self.group_vars: dict[str, dict] = {}

    def get(self, kind: str, name: str) -> dict:
        if kind == "group_vars" and name in self.group_vars:
            return self.group_vars[name]
        names = self.names[kind]
        found = _vars_from(self.folders, kind, name) if names and any(name + ext in names for ext in _YAML_EXTS) else {}
        if kind == "group_vars":
            self.group_vars[name] = found
        return found


def read_files(paths: list[Path]) -> Inventory:
    tree = _Tree()
    for path in paths:
        _read_source(path, tree)
    tree.reconcile()
    depth = tree.depths()  # first: it refuses a tree too deep before any work that grows with depth
    folders = [p if p.is_dir() else p.parent for p in paths]
    folders = list(dict.fromkeys(folders))
    order = tree.hosts_of("all")
    group_hosts = {name: tree.hosts_of(name) for name in tree.groups}
    member: dict[str, set[str]] = {h: {"all"} for h in order}
    for group, hosts in group_hosts.items():
        for h in hosts:
            member[h].add(group)

    def priority(group: str) -> int:
        try:
            return int(tree.group(group).vars.get("ansible_group_priority", 1))
        except (TypeError, ValueError):
            return 1

    vars_files = _VarsFiles(folders)
    entries = []
    for name in order:
        ranked = sorted(member[name] - {"all"}, key=lambda g: (depth[g], priority(g), g))
        merged: dict = dict(tree.group("all").vars)
        for group in ranked:
            merged.update(tree.group(group).vars)
        merged.update(vars_files.get("group_vars", "all"))
        for group in ranked:
            merged.update(vars_files.get("group_vars", group))
        merged.update(tree.host_vars.get(name, {}))
        merged.update(vars_files.get("host_vars", name))
        entries.append(Entry(name, merged, tuple(sorted(member[name]))))
    return Inventory(entries, group_hosts, "built-in")
