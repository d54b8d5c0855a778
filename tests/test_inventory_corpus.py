"""The built-in inventory reader against ansible-core itself (the pinned test extra): each inventory
of the corpus is read by `ansible-inventory --list` and by patcher, and the hosts, their order and
what ssh would be given (address, port, user, key, ssh args, interpreter, become) must agree. `--limit`
patterns are compared with `ansible all --list-hosts --limit`. Where patcher differs on purpose the
case is listed in EXPECTED_DIFFERENCES (and docs/remote.md), and the test checks that it still differs;
where the built-in reader cannot read what Ansible reads, it must refuse with one line that says why
and what to do (REFUSED).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from patcher.fleet.inventory import InventoryError, load_hosts
from patcher.fleet.inventory_files import NEEDS_ANSIBLE

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-inventory").exists(),
    reason="ansible-core (pinned in the test extra) is not installed: pip install -e '.[test]'",
)


@dataclass
class Case:
    name: str
    files: dict[str, str]
    source: str = "hosts"
    limits: tuple[str, ...] = ()
    executable: tuple[str, ...] = ()
    rendered: tuple[str, ...] = ()  # variables holding Jinja: their values as Ansible renders them


GROUPED = (
    "[all:vars]\nansible_user=admin\n\n[web]\nweb1 ansible_host=127.0.0.2\nweb2 ansible_host=127.0.0.3\nweb3\n\n"
    "[db]\ndb1 ansible_host=127.0.0.4\ndb2\n\n[prod:children]\nweb\ndb\n\n[canary]\nweb2\n"
)

CORPUS = [
    Case("ini-groups-vars-children", {"hosts": GROUPED}),
    Case("ini-header-with-comment", {"hosts": "[web] # the front ends\nweb1\nweb2\n[db]   # databases\ndb1\n"}),
    Case("ini-host-port-beats-all-vars", {"hosts": "[all:vars]\nansible_port=22\n[web]\nweb1\nweb2:2242\n"}),
    Case("ini-explicit-port-var-beats-host-port", {"hosts": "web2:2242 ansible_port=2300\n"}),
    Case(
        "group-and-host-vars-beside",
        {
            "hosts": "[web]\nweb1\nweb2 ansible_user=own\n[db]\ndb1\n",
            "group_vars/all.yml": "ansible_user: everyone\nansible_port: 2201\n",
            "group_vars/web.yml": "ansible_user: webuser\nansible_python_interpreter: /opt/web/bin/python3\n",
            "host_vars/web1.yaml": "ansible_port: 2222\n",
            "host_vars/web2": "ansible_user: from-host-vars\n",
        },
    ),
    Case(
        "group-vars-directory-and-json",
        {
            "hosts.ini": "[gpus]\ngpu1\ngpu2\n[cpu]\ncpu1\n",
            "group_vars/gpus/10-user.yml": "ansible_user: gpuadmin\n",
            "group_vars/gpus/20-port.yaml": "ansible_port: 2210\nansible_user: gpuadmin2\n",
            "group_vars/cpu.json": '{"ansible_port": 2299}',
        },
        source="hosts.ini",
    ),
    Case(
        "group-vars-beat-inventory-group-vars",
        {
            "hosts": "[web]\nweb1\n[web:vars]\nansible_user=from-ini\n[all:vars]\nansible_port=2000\n",
            "group_vars/all": "ansible_port: 2001\n",
            "group_vars/web.yml": "ansible_user: from-group-vars\n",
        },
    ),
    Case(
        "directory-inventory",
        {
            "inv/01-web.ini": "[web]\nweb1\nweb2\n",
            "inv/02-db.yml": "all:\n  children:\n    db:\n      hosts:\n        db1: {ansible_port: 2400}\n",
            "inv/README.md": "not an inventory\n",
            "inv/old.retry": "ignored\n",
            "inv/group_vars/web.yml": "ansible_user: web-admin\n",
        },
        source="inv",
    ),
    Case(
        "ssh-key-common-and-extra-args",
        {
            "hosts": "[gpus]\ngpu1 ansible_ssh_private_key_file=/keys/gpu ansible_ssh_extra_args='-o ServerAliveInterval=5'\n"
            "gpu2\n[gpus:vars]\nansible_ssh_common_args='-o ProxyJump=admin@127.0.0.9 -o Compression=yes'\n",
        },
    ),
    Case("private-key-modern-name", {"hosts": "gpu1 ansible_private_key_file=~/.ssh/gpu\n"}),
    Case(
        "ssh-spelling-wins-over-plain",
        {
            "hosts": "h1 ansible_port=2000 ansible_ssh_port=2001 ansible_user=a ansible_ssh_user=b "
            "ansible_host=127.0.0.5 ansible_ssh_host=127.0.0.6\n"
        },
    ),
    Case(
        "legacy-ssh-names", {"hosts": "h1 ansible_ssh_host=127.0.0.7 ansible_ssh_port=2022 ansible_ssh_user=legacy\n"}
    ),
    Case("letter-range", {"hosts": "[nodes]\nnode[a:c].lab\n"}),
    Case("step-range-and-padding", {"hosts": "[w]\nw[1:5:2]\ngpu[01:10:3]\n"}),
    Case("nested-ranges", {"hosts": "db[1:2]-[a:b]\n"}),
    Case(
        "yaml-ranges-and-port-key",
        {"fleet.yml": "all:\n  hosts:\n    gpu[1:3]:\n    web2:2242:\n      ansible_user: u\n"},
        source="fleet.yml",
    ),
    Case(
        "local-host-left-out-by-limit",
        {"hosts": "localhost ansible_connection=local\n[gpus]\ngpu1\ngpu2\n"},
        limits=("gpus", "!localhost", "all:!localhost"),
    ),
    Case(
        "become-user-postgres-left-out-by-limit",
        {"hosts": "[db]\ndb1 ansible_become=true ansible_become_user=postgres\n[gpus]\ngpu1 ansible_become=true\n"},
        limits=("gpus", "!db"),
    ),
    Case(
        "jinja-variable-references",
        {
            "hosts": "[all:vars]\nbase_port=2300\nteam=ml\n[gpus]\ngpu1 ansible_port='{{ base_port }}' ansible_user='{{ team }}-ops'\n"
        },
        rendered=("ansible_port", "ansible_user"),
    ),
    Case(
        "limit-patterns",
        {"hosts": GROUPED},
        limits=(
            "web:db",
            "prod:!db",
            "prod:&canary",
            "web[0]",
            "web[1:]",
            "web[-1]",
            "~web[12]",
            "~^d",
            "w*",
            "db1,web3",
            "web,!canary",
            "all",
        ),
    ),
    Case(
        "yaml-nested-children-precedence",
        {
            "fleet.yml": "all:\n  vars: {ansible_user: root, ansible_python_interpreter: /usr/bin/python3}\n"
            "  hosts:\n    lone.lab:\n  children:\n    gpus:\n      vars: {ansible_python_interpreter: /root/ml/bin/python3}\n"
            "      hosts:\n        gpu01: {ansible_host: 127.0.0.8}\n      children:\n        big:\n"
            "          vars: {ansible_python_interpreter: /opt/big/bin/python3, ansible_port: 2200}\n"
            "          hosts:\n            gpu02:\n            gpu[10:11]:\n",
        },
        source="fleet.yml",
        limits=("gpus", "big", "gpus[0]"),
    ),
    Case(
        "yaml-without-suffix",
        {"hosts": "all:\n  children:\n    gpus:\n      hosts:\n        gpu1:\n        gpu2: {ansible_port: 2202}\n"},
    ),
    Case(
        "same-depth-groups-by-name",
        {"hosts": "[b]\nh1\n[a]\nh1\n[a:vars]\nansible_user=from-a\n[b:vars]\nansible_user=from-b\n"},
    ),
    Case(
        "group-priority",
        {
            "hosts": "[b]\nh1\n[a]\nh1\n[a:vars]\nansible_user=from-a\nansible_group_priority=5\n"
            "[b:vars]\nansible_user=from-b\n"
        },
    ),
    Case("children-declared-first", {"hosts": "[prod:children]\nweb\n[prod:vars]\nansible_port=2500\n[web]\nweb1\n"}),
    Case("host-in-two-groups", {"hosts": "[a]\nh1\n[b]\nh1 ansible_port=2600\nh2\n[a:vars]\nansible_user=ua\n"}),
    Case(
        "become-variants",
        {
            "hosts": "[gpus]\ngpu1\ngpu2 ansible_become=false\ngpu3 ansible_become=yes ansible_become_method=sudo\n"
            "[gpus:vars]\nansible_become=true\n"
        },
    ),
    Case(
        "interpreter-discovery",
        {"hosts": "gpu1 ansible_python_interpreter=auto_silent\ngpu2 ansible_python_interpreter=/x/python3\n"},
    ),
    Case("plain-list-with-comments", {"hosts": "# GPU hosts\n127.0.0.2\n\ngpu-07   # the odd one\n127.0.0.3:2222\n"}),
    Case(
        "ungrouped-and-all-hosts-yaml",
        {
            "fleet.yaml": "all:\n  hosts:\n    a1:\n  children:\n    ungrouped:\n      hosts:\n        u1:\n"
            "    g:\n      hosts:\n        a1:\n"
        },
        source="fleet.yaml",
    ),
    Case(
        "constructed-plugin",
        {
            "inv/01-hosts.ini": "gpu1\ncpu1\n",
            "inv/02-constructed.yml": "plugin: ansible.builtin.constructed\nstrict: true\ngroups:\n  gpus: \"'gpu' in inventory_hostname\"\n"
            "compose:\n  ansible_port: '2700'\n",
        },
        source="inv",
    ),
    Case(
        "script-inventory",
        {
            "inventory.sh": '#!/bin/sh\necho \'{"gpus": {"hosts": ["gpu1"], "vars": {"ansible_port": 2800}}, "_meta": {"hostvars": {}}}\'\n'
        },
        source="inventory.sh",
        executable=("inventory.sh",),
    ),
    Case("group-vars-inline-comment", {"hosts": "[g]\nh1\n[g:vars]\nansible_user=admin  # the ops team\n"}),
    Case("user-at-host-port-plain-list", {"hosts": "root@127.0.0.2:2222\nroot@127.0.0.3\n"}),
    Case("address-pattern-is-not-a-name", {"hosts": GROUPED}, limits=("127.0.0.2*",)),
]

# Where the built-in reader differs from Ansible on purpose (docs/remote.md, "Inventories as Ansible reads them").
EXPECTED_DIFFERENCES = {
    "group-vars-inline-comment": "an inline `# comment` after an unquoted [group:vars] value is dropped by patcher; "
    "Ansible keeps it in the value (the user `admin  # the ops team`)",
    "user-at-host-port-plain-list": "patcher's plain lists may write `user@host:port`: patcher reads user and port "
    "from it; Ansible takes the whole token as a host name",
    "address-pattern-is-not-a-name": "a --limit term that matches nothing is refused by patcher (a typo must not leave "
    "hosts unpatched or fail to keep hosts out); Ansible warns and goes on with no host",
}
# What the built-in reader cannot read as Ansible does: refused with the reason and the fix.
REFUSED = {
    "constructed-plugin": "an inventory plugin's configuration (plugin: ansible.builtin.constructed) needs ansible-core",
    "script-inventory": "is an executable script: running it needs ansible-core",
}


def materialize(case: Case, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in case.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755 if rel in case.executable else 0o644)
    return root / case.source


def ansible(tool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
        "ANSIBLE_LOCAL_TEMP": str(cwd / ".ansible-tmp"),
        "ANSIBLE_HOME": str(cwd / ".ansible-home"),
    }
    done = subprocess.run([str(BIN / tool), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    return done


def ansible_inventory(source: Path, cwd: Path) -> dict:
    done = ansible("ansible-inventory", "-i", str(source), "--list", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# ansible-core's own pattern code (InventoryManager.subset, as `ansible --limit` uses it), for every
# pattern of a case in one process: an `ansible --list-hosts` per pattern costs seconds each.
_LIMITS = """
import json, sys
from ansible.parsing.dataloader import DataLoader
from ansible.inventory.manager import InventoryManager
out = {}
for pattern in sys.argv[2:]:
    inventory = InventoryManager(loader=DataLoader(), sources=[sys.argv[1]])
    inventory.subset(pattern)
    out[pattern] = [h.name for h in inventory.get_hosts("all")]
print(json.dumps(out))
"""


def ansible_limits(source: Path, patterns: tuple[str, ...], cwd: Path) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _LIMITS, str(source), *patterns],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "ANSIBLE_HOME": str(cwd / ".ansible-home")},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def ansible_rendered(source: Path, variables: tuple[str, ...], cwd: Path) -> dict[str, dict]:
    """What Ansible renders the variables to for each host (an ad-hoc debug: nothing is contacted)."""
    expression = "{{ {" + ", ".join(f"'{v}': {v}" for v in variables) + "} }}"
    done = subprocess.run(
        [str(BIN / "ansible"), "all", "-i", str(source), "-m", "debug", "-a", f"msg={expression}"],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={
            **os.environ,
            "ANSIBLE_STDOUT_CALLBACK": "oneline",
            "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_LOCAL_TEMP": str(cwd / ".ansible-tmp"),
            "ANSIBLE_HOME": str(cwd / ".ansible-home"),
        },
    )
    assert done.returncode == 0, done.stderr + done.stdout
    found = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(" | SUCCESS => ")
        if rest:
            found[name.strip()] = json.loads(rest)["msg"]
    return found


def ansible_order(data: dict) -> list[str]:
    """The hosts of `all` in ansible-core's order: each group's own hosts, generation by generation."""
    order, level, seen = [], ["all"], {"all"}
    while level:
        nxt = []
        for group in level:
            order += [h for h in (data.get(group) or {}).get("hosts", []) if h not in order]
            for child in (data.get(group) or {}).get("children", []):
                if child not in seen:
                    seen.add(child)
                    nxt.append(child)
        level = nxt
    return order


def what_ansible_connects_with(name: str, variables: dict) -> dict:
    def last(*keys):  # ansible-core's option resolution: of the spellings set, the last listed wins
        value = None
        for key in keys:
            if variables.get(key) is not None:
                value = variables[key]
        return value

    python = last("ansible_python_interpreter")
    become = str(last("ansible_become") or "false").lower() in ("true", "yes", "1", "on")
    port = last("ansible_port", "ansible_ssh_port")
    args = []
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        args += shlex.split(str(variables.get(key) or ""))
    return {
        "address": str(last("ansible_host", "ansible_ssh_host") or name),
        "port": None if port is None else int(port),
        "user": last("ansible_user", "ansible_ssh_user"),
        "key_file": last("ansible_private_key_file", "ansible_ssh_private_key_file"),
        "ssh_args": tuple(args),
        # interpreter discovery (auto*) is patcher's --python (python3 on the host's PATH by default)
        "python": None if python is None or str(python).startswith("auto") else str(python),
        "become": become,
    }


def what_patcher_connects_with(host) -> dict:
    return {
        "address": host.address,
        "port": host.port,
        "user": host.user,
        "key_file": host.key_file,
        "ssh_args": host.ssh_args,
        "python": host.python,
        "become": host.become,
    }


def compare(case: Case, root: Path, reader: str | None = None) -> list[str]:
    """Every disagreement between patcher (its built-in reader, or `reader`: an ansible-inventory)
    and ansible-core on this case."""
    source = materialize(case, root)
    data = ansible_inventory(source, root)
    hostvars = data["_meta"]["hostvars"]
    if case.rendered:
        for host, values in ansible_rendered(source, case.rendered, root).items():
            hostvars.setdefault(host, {}).update(values)
    differences = []
    # the order of `all` too: the JSON cannot tell it (hosts set directly under `all` are listed in no group)
    limited = ansible_limits(source, ("all", *case.limits), root)
    assert set(limited["all"]) == set(ansible_order(data))
    for pattern in case.limits or (None,):
        wanted = limited["all" if pattern is None else pattern]
        try:
            hosts = load_hosts([], [str(source)], pattern, reader).hosts
        except InventoryError as exc:
            differences.append(f"--limit {pattern}: patcher refused: {exc}")
            continue
        # --list's JSON does not hold ansible-core's run order where plugins add hosts to groups or hosts
        # sit right under `all`: through ansible-inventory, patcher runs hosts in the JSON's order
        ours = [h.name for h in hosts] if reader is None else sorted(h.name for h in hosts)
        if ours != (wanted if reader is None else sorted(wanted)):
            differences.append(f"--limit {pattern}: hosts {[h.name for h in hosts]} != Ansible's {wanted}")
        for host in hosts:
            ours = what_patcher_connects_with(host)
            theirs = what_ansible_connects_with(host.name, hostvars.get(host.name, {}))
            if ours != theirs:
                differences.append(f"{host.name}: {ours} != Ansible's {theirs}")
    return differences


def test_the_corpus_is_large_enough():
    assert len(CORPUS) >= 30
    assert len({c.name for c in CORPUS}) == len(CORPUS)
    assert set(EXPECTED_DIFFERENCES) | set(REFUSED) <= {c.name for c in CORPUS}


def _run(case: Case, tmp_path: Path) -> tuple[Case, list[str]]:
    return case, compare(case, tmp_path / case.name)


def test_the_built_in_reader_agrees_with_ansible_core(tmp_path: Path):
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda c: _run(c, tmp_path), CORPUS))
    problems = []
    for case, differences in outcomes:
        if case.name in REFUSED:
            assert differences, f"{case.name}: the built-in reader now reads it; take it out of REFUSED"
            for line in differences:
                assert REFUSED[case.name] in line and NEEDS_ANSIBLE in line, line
        elif case.name in EXPECTED_DIFFERENCES:
            assert differences, f"{case.name}: no longer differs from Ansible; take it out of EXPECTED_DIFFERENCES"
        elif differences:
            problems.append(f"{case.name}:\n  " + "\n  ".join(differences))
    assert not problems, "\n".join(problems)


# What the built-in reader refuses or reads differently, and the formats only ansible-core reads,
# through patcher's other reader: ansible-inventory itself.
THROUGH_ANSIBLE = ["constructed-plugin", "script-inventory", "jinja-variable-references", "limit-patterns"]


def test_the_ansible_inventory_reader_agrees_with_ansible_core(tmp_path: Path):
    cases = [c for c in CORPUS if c.name in THROUGH_ANSIBLE]
    reader = str(BIN / "ansible-inventory")
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda c: (c, compare(c, tmp_path / c.name, reader)), cases))
    problems = [f"{case.name}:\n  " + "\n  ".join(d) for case, d in outcomes if d]
    assert not problems, "\n".join(problems)


def test_a_broken_source_is_an_error_through_ansible_inventory(tmp_path: Path):
    bad = tmp_path / "hosts.yml"
    bad.write_text("all:\n  hosts: [\n")
    with pytest.raises(InventoryError) as error:
        load_hosts([], [str(bad)], None, str(BIN / "ansible-inventory"))
    message = str(error.value)
    assert message.startswith(f"ansible-inventory cannot read {bad}") and "\n" not in message, message
