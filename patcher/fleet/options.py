"""What a run is told about remote targets (--host, --inventory and the fleet and ssh options),
as one value. It lives with the fleet because every run that names a host is a fleet run (of
one host, perhaps): the fleet command turns these settings into hosts, a rollout and the ssh
transport's own `SshSettings`. Standard library only, so the CLI builds it for every command,
local runs included, without loading ssh or inventory code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

DEFAULT_FORKS = 8  # rollout's default too (it imports it from here)
DEFAULT_CONNECT_TIMEOUT = 10
# The retry file's name in $PATCHER_CACHE when no --retry-file is given: never the current folder,
# which is often a git checkout (Ansible too writes retry files only where asked).
DEFAULT_RETRY_NAME = "patcher.retry"


@dataclass(frozen=True)
class RemoteOptions:
    """The remote settings of one run; `RemoteOptions()` is a local run's (no host named)."""

    # Which hosts: --host addresses ([user@]host[:port]) and --inventory sources, read with
    # --ansible-inventory's program (None: the one beside patcher, if any) unless
    # --no-ansible-inventory, then narrowed by --limit (Ansible's host patterns).
    hosts: tuple[str, ...] = ()
    inventories: tuple[str, ...] = ()
    ansible_inventory: str | None = None
    no_ansible_inventory: bool = False
    limit: str | None = None

    # How the rollout goes: --forks hosts at once, --serial batches ("N" or "N%"; None: one
    # batch), stopping once more than --max-fail percent of a batch failed (None: never).
    forks: int = DEFAULT_FORKS
    serial: str | None = None
    max_fail: float | None = None

    # How each host is reached: the remote side under `sudo -n`, extra `ssh -o` options
    # (KEY=VALUE, checked before use), `ssh -F` file, and ssh's ConnectTimeout in seconds.
    sudo: bool = False
    ssh_options: tuple[str, ...] = ()
    ssh_config: str | None = None
    connect_timeout: int = DEFAULT_CONNECT_TIMEOUT

    # After the rollout: where the hosts that did not succeed are listed: --retry-file PATH, or
    # (None) $PATCHER_CACHE/DEFAULT_RETRY_NAME; nowhere with --no-retry-file.
    retry_file: str | None = None
    no_retry_file: bool = False

    # The settings that mean nothing without a remote host, with the flag each comes from
    # (for the refusal's message), in the order the message names them.
    REMOTE_ONLY: ClassVar[tuple[tuple[str, str], ...]] = (
        ("sudo", "--sudo"),
        ("limit", "--limit"),
        ("ssh_options", "--ssh-option"),
        ("ssh_config", "--ssh-config"),
        ("ansible_inventory", "--ansible-inventory"),
        ("serial", "--serial"),
        ("max_fail", "--max-fail"),
    )

    @property
    def is_fleet(self) -> bool:
        """Whether the run goes to remote hosts (one or many) rather than a local interpreter."""
        return bool(self.hosts or self.inventories)

    def remote_only_given(self) -> list[str]:
        """The flags of remote-only settings that were given (a local run refuses them)."""
        return [flag for field, flag in self.REMOTE_ONLY if getattr(self, field)]
