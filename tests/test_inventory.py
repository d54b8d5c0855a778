"""Host strings, inventories and the remote command line, without any network."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from patcher.fleet.host_address import Host, HostError, parse_host
from patcher.fleet.inventory import InventoryError, hosts_from_options, inventory_line, load_hosts, read_inventory
from patcher.transport.ssh import SshSettings, SshTransport


def test_host_strings():
    assert parse_host("10.1.2.3") == Host("10.1.2.3", "10.1.2.3")
    assert parse_host("root@10.1.2.3:2222") == Host("root@10.1.2.3:2222", "10.1.2.3", "root", 2222)
    assert parse_host("gpu-07.lab").address == "gpu-07.lab"
    assert parse_host("[fe80::1%eth0]:22") == Host("[fe80::1%eth0]:22", "fe80::1%eth0", None, 22)
    assert parse_host("ubuntu@::1") == Host("ubuntu@::1", "::1", "ubuntu", None)
    for bad in ["-oProxyCommand=x", "a b", "a;b", "a$(id)", "h:0", "h:65536", "[::1", "u@-h", "-u@h", "h\n", "h|x"]:
        with pytest.raises(HostError):
            parse_host(bad)


def test_plain_list_and_ini_inventory(tmp_path: Path):
    plain = tmp_path / "hosts"
    plain.write_text(
        "# GPU hosts\nroot@10.1.2.3\n\n10.1.2.4:2222   # the odd one\ngpu-07 ansible_python_interpreter='/root/ml env/bin/python3'\n"
    )
    hosts = read_inventory(plain)
    assert [h.name for h in hosts] == ["root@10.1.2.3", "10.1.2.4", "gpu-07"]  # `host:port` is host and port
    assert hosts[1].port == 2222
    assert hosts[2].python == "/root/ml env/bin/python3"
    ini = tmp_path / "hosts.ini"
    ini.write_text(
        "[all:vars]\nansible_user=admin\n\n"
        "[gpus]\ngpu[01:03].lab\ngpu09 ansible_host=10.0.0.9 ansible_port=2222 ansible_user=root\n\n"
        "[gpus:vars]\nansible_python_interpreter=/root/ml-env/bin/python3\n\n"
        "[big]\ngpu02.lab ansible_python_interpreter=/opt/big/bin/python3\n\n"
        "[fleet:children]\ngpus\nbig\n"
    )
    hosts = {h.name: h for h in read_inventory(ini)}
    assert list(hosts) == ["gpu01.lab", "gpu02.lab", "gpu03.lab", "gpu09"]
    assert hosts["gpu01.lab"] == Host("gpu01.lab", "gpu01.lab", "admin", None, "/root/ml-env/bin/python3")
    assert hosts["gpu02.lab"].python == "/opt/big/bin/python3"  # a host variable wins
    assert hosts["gpu09"] == Host("gpu09", "10.0.0.9", "root", 2222, "/root/ml-env/bin/python3")
    # a retry-file line reads back as the same host
    for host in hosts.values():
        line = tmp_path / "one"
        line.write_text(inventory_line(host) + "\n")
        assert read_inventory(line) == [host]


def test_yaml_inventory_nesting_and_precedence(tmp_path: Path):
    inventory = tmp_path / "fleet.yml"
    inventory.write_text(
        "all:\n"
        "  vars: {ansible_user: root, ansible_python_interpreter: /usr/bin/python3}\n"
        "  hosts:\n    lone.lab:\n"
        "  children:\n"
        "    gpus:\n"
        "      vars: {ansible_python_interpreter: /root/ml-env/bin/python3}\n"
        "      hosts:\n        gpu01: {ansible_host: 10.1.2.3}\n"
        "      children:\n"
        "        big:\n"
        "          vars: {ansible_python_interpreter: /opt/big/bin/python3, ansible_port: 2200}\n"
        "          hosts:\n            gpu02:\n            gpu[10:11]:\n"
        "    auto:\n"
        "      hosts: {gpu03: {ansible_python_interpreter: auto_silent}}\n"
    )
    hosts = {h.name: h for h in read_inventory(inventory)}
    assert hosts["lone.lab"].python == "/usr/bin/python3"
    assert hosts["gpu01"] == Host("gpu01", "10.1.2.3", "root", None, "/root/ml-env/bin/python3")
    assert hosts["gpu02"] == Host("gpu02", "gpu02", "root", 2200, "/opt/big/bin/python3")  # deepest group wins
    assert {"gpu10", "gpu11"} <= set(hosts)
    assert hosts["gpu03"].python is None  # Ansible's discovery: --python decides


def test_bad_inventories_are_refused_with_the_place(tmp_path: Path):
    cases = {
        "hosts": "good.lab\n-oProxyCommand=x\n",
        "hosts.ini": "[gpus]\nevil ansible_host='a;reboot'\n",
        "local.ini": "here ansible_connection=local\n",
        "script": "#!/bin/sh\necho {}\n",
        "broken.yml": "all:\n  hosts: [\n",
        "empty": "# nothing\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o755)
        with pytest.raises((InventoryError, HostError)):
            read_inventory(path)
    with pytest.raises(InventoryError, match="does not exist"):
        read_inventory(tmp_path / "missing")


def test_duplicates_once_and_command_line_first(tmp_path: Path):
    inventory = tmp_path / "hosts"
    inventory.write_text("root@10.1.2.3\nroot@10.1.2.4\n")
    hosts = hosts_from_options(["root@10.1.2.4"], [str(inventory)])
    assert [h.name for h in hosts] == ["root@10.1.2.4", "root@10.1.2.3"]


def test_remote_command_quotes_every_word():
    t = SshTransport(parse_host("root@gpu.lab:2222"), "/opt/my env/$(reboot)/python3", SshSettings(sudo=True))
    argv = t.command()
    assert argv[-3:-1] == ["--", "gpu.lab"] and ["-p", "2222"] == argv[argv.index("-p") : argv.index("-p") + 2]
    words = shlex.split(argv[-1])
    assert words[:4] == ["sudo", "-n", "--", "/opt/my env/$(reboot)/python3"]
    assert words[4] == "-c" and words[5].startswith("import sys;") and "\n" not in argv[-1]  # tcsh reads it too
    assert argv.index("BatchMode=yes") < argv.index("StrictHostKeyChecking=accept-new")
    home = SshTransport(parse_host("gpu.lab"), "~/ml-env/bin/python3", SshSettings()).remote_command()
    assert home.startswith('"$HOME"/ml-env/bin/python3 -c ')
    user_first = SshTransport(
        parse_host("gpu.lab"), None, SshSettings(options=("StrictHostKeyChecking=yes",))
    ).command()
    assert user_first.index("StrictHostKeyChecking=yes") < user_first.index("StrictHostKeyChecking=accept-new")


GROUPED = (
    "[all:vars]\nansible_user=admin\n\n"
    "[gpus]\ngpu[01:04].lab\n\n[gpus:vars]\nansible_become=yes\n\n"
    "[canary]\ngpu01.lab ansible_become=false\n\n"
    "[cpu]\ncpu01.lab ansible_host=10.9.9.1\n\n"
    "[fleet:children]\ngpus\n"
)


def test_groups_and_become_from_the_inventory(tmp_path: Path):
    path = tmp_path / "hosts.ini"
    path.write_text(GROUPED)
    hosts = {h.name: h for h in read_inventory(path)}
    assert hosts["gpu02.lab"].become and hosts["gpu04.lab"].become
    assert not hosts["gpu01.lab"].become  # the host's own variable wins over its group's
    assert not hosts["cpu01.lab"].become
    assert hosts["gpu02.lab"].groups == ("all", "fleet", "gpus")
    assert hosts["gpu01.lab"].groups == ("all", "canary", "fleet", "gpus")
    line = tmp_path / "one"
    line.write_text(inventory_line(hosts["gpu02.lab"]) + "\n")
    assert read_inventory(line) == [hosts["gpu02.lab"]]  # a retry file keeps ansible_become
    settings = SshSettings()
    assert SshTransport(hosts["gpu02.lab"], None, settings).remote_command().startswith("sudo -n -- ")
    assert not SshTransport(hosts["gpu01.lab"], None, settings).remote_command().startswith("sudo")


@pytest.mark.parametrize(
    "variables,message",
    [
        ("ansible_become=maybe", "ansible_become=maybe is not a boolean"),
        ("ansible_become=true ansible_become_method=su", "ansible_become_method=su is not supported"),
        ("ansible_become=true ansible_become_user=postgres", "ansible_become_user=postgres is not supported"),
    ],
)
def test_become_is_sudo_to_root_or_refused(tmp_path: Path, variables: str, message: str):
    path = tmp_path / "hosts"
    path.write_text(f"gpu01 {variables}\n")
    with pytest.raises(InventoryError, match=f"host 'gpu01': {message}"):
        read_inventory(path)


@pytest.mark.parametrize(
    "pattern,expected",
    [
        ("gpus", ["gpu01.lab", "gpu02.lab", "gpu03.lab", "gpu04.lab"]),
        ("gpus,!canary", ["gpu02.lab", "gpu03.lab", "gpu04.lab"]),
        ("gpu0[23]*", ["gpu02.lab", "gpu03.lab"]),
        ("fleet,&canary", ["gpu01.lab"]),
        ("!gpus", ["cpu01.lab"]),
        # Ansible's order (all's children, generation by generation), not the pattern's
        ("cpu01.lab, gpu03.lab", ["cpu01.lab", "gpu03.lab"]),
        ("gpus:!canary", ["gpu02.lab", "gpu03.lab", "gpu04.lab"]),  # ':' separates terms too
        ("gpus[0]", ["gpu01.lab"]),
        ("gpus[1:2]", ["gpu02.lab", "gpu03.lab"]),
        ("gpus[-1]", ["gpu04.lab"]),
        ("~gpu0[12]", ["gpu01.lab", "gpu02.lab"]),
        ("~c.u", ["cpu01.lab"]),
        ("all,!gpu0[1-3].lab", ["cpu01.lab", "gpu04.lab"]),
    ],
)
def test_limit_reads_patterns_as_ansible_does(tmp_path: Path, pattern: str, expected: list[str]):
    path = tmp_path / "hosts.ini"
    path.write_text(GROUPED)
    assert [h.name for h in load_hosts([], [str(path)], pattern).hosts] == expected


@pytest.mark.parametrize(
    "pattern,message",
    [
        ("gpux", "--limit: 'gpux' matches no host or group; groups: canary, cpu, fleet, gpus; check the name"),
        ("gpus,!gpus", "--limit 'gpus,!gpus' leaves no host to run on"),
        (" , ", "--limit needs a pattern"),
        ("10.9.9.*", "--limit: '10.9.9.*' matches no host or group"),  # names only, never ansible_host
        ("gpus,!gpux", "--limit: 'gpux' matches no host or group"),  # a typo in an exclusion too
        ("gpus[7]", "--limit: no host at position 7 of 'gpus'"),
    ],
)
def test_limit_mistakes_are_refused(tmp_path: Path, pattern: str, message: str):
    path = tmp_path / "hosts.ini"
    path.write_text(GROUPED)
    with pytest.raises(InventoryError) as error:
        load_hosts([], [str(path)], pattern)
    assert str(error.value).startswith(message)
