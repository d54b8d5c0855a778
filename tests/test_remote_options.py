"""The remote flags become one RemoteOptions value (patcher.fleet.options) in one place, the CLI's
`remote_options` decorator: every field is reachable from its flag, and a run without flags is
a local run. What each setting does is tests/test_remote.py's and tests/test_inventory.py's."""

from __future__ import annotations

from dataclasses import fields

import click
from click.testing import CliRunner

from patcher.cli.patcher_command import remote_options
from patcher.fleet.options import RemoteOptions

EVERY_FLAG = [
    "--host",
    "root@10.0.0.1:2222",
    "--inventory",
    "hosts.ini",
    "--ansible-inventory",
    "/opt/ansible-inventory",
    "--no-ansible-inventory",
    "--limit",
    "web",
    "--forks",
    "3",
    "--serial",
    "25%",
    "--max-fail",
    "10",
    "--sudo",
    "--ssh-option",
    "IdentityFile=~/.ssh/gpu",
    "--ssh-config",
    "ssh.cfg",
    "--connect-timeout",
    "5",
    "--retry-file",
    "failed.retry",
    "--no-retry-file",
]


def given(args: list[str]) -> RemoteOptions:
    seen: list[RemoteOptions] = []

    @click.command()
    @remote_options
    def probe(remote: RemoteOptions) -> None:
        seen.append(remote)

    done = CliRunner().invoke(probe, args)
    assert done.exit_code == 0, done.output
    return seen[0]


def test_every_flag_reaches_its_field():
    remote = given(EVERY_FLAG)
    assert remote == RemoteOptions(
        hosts=("root@10.0.0.1:2222",),
        inventories=("hosts.ini",),
        ansible_inventory="/opt/ansible-inventory",
        no_ansible_inventory=True,
        limit="web",
        forks=3,
        serial="25%",
        max_fail=10.0,
        sudo=True,
        ssh_options=("IdentityFile=~/.ssh/gpu",),
        ssh_config="ssh.cfg",
        connect_timeout=5,
        retry_file="failed.retry",
        no_retry_file=True,
    )
    untouched = [f.name for f in fields(RemoteOptions) if getattr(remote, f.name) == getattr(RemoteOptions(), f.name)]
    assert untouched == [], "a RemoteOptions field no flag sets: map it in remote_options"
    assert remote.is_fleet


def test_no_flags_is_a_local_run_with_the_documented_defaults():
    remote = given([])
    assert remote == RemoteOptions()
    assert not remote.is_fleet
    assert (remote.forks, remote.connect_timeout, remote.retry_file, remote.no_retry_file) == (8, 10, None, False)
    assert given(["--no-retry-file"]).no_retry_file is True


def test_remote_only_settings_are_named_by_their_flags_in_order():
    names = {f.name for f in fields(RemoteOptions)}
    assert {name for name, _ in RemoteOptions.REMOTE_ONLY} <= names
    assert RemoteOptions(max_fail=5, sudo=True, limit="web").remote_only_given() == ["--sudo", "--limit", "--max-fail"]
    assert RemoteOptions(forks=2, connect_timeout=3).remote_only_given() == []  # they have defaults: not refused
