"""Host strings, inventories and the remote command line, without any network."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from patcher.inventory import InventoryError, hosts_from_options, inventory_line, read_inventory
from patcher.ssh import Host, HostError, SshSettings, SshTransport, parse_host


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
    plain.write_text("# GPU hosts\nroot@10.1.2.3\n\n10.1.2.4:2222   # the odd one\ngpu-07 ansible_python_interpreter='/root/ml env/bin/python3'\n")
    hosts = read_inventory(plain)
    assert [h.name for h in hosts] == ["root@10.1.2.3", "10.1.2.4:2222", "gpu-07"]
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
        "broken.yml": "all:\n  hosts: [\n",
        "empty": "# nothing\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
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
    assert words[4] == "-c" and words[5].startswith("import sys,json")
    assert argv.index("BatchMode=yes") < argv.index("StrictHostKeyChecking=accept-new")
    home = SshTransport(parse_host("gpu.lab"), "~/ml-env/bin/python3", SshSettings()).remote_command()
    assert home.startswith('"$HOME"/ml-env/bin/python3 -c ')
    user_first = SshTransport(parse_host("gpu.lab"), None, SshSettings(options=("StrictHostKeyChecking=yes",))).command()
    assert user_first.index("StrictHostKeyChecking=yes") < user_first.index("StrictHostKeyChecking=accept-new")
