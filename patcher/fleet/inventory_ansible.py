"""Inventories read by ansible-core itself: `ansible-inventory -i SRC... --list`, so every format
it reads (INI, YAML, TOML, directories, group_vars/ host_vars/, executable scripts, inventory
plugins such as aws_ec2, gcp_compute, kubernetes.core.k8s or constructed) gives exactly the
hosts, groups and variables Ansible would use. A source it cannot parse is an error here (not
Ansible's warning and an empty inventory).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path

from .inventory_files import Entry, Inventory, InventoryError, limit_from_environment

TIMEOUT = 300  # a cloud plugin may page through many instances; never forever
OUTPUT_VARIABLE = "PATCHER_INVENTORY_MAX_MIB"


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if "ERROR" in line:
            return line.split("]:", 1)[-1].strip() if line.startswith("[") else line
    return lines[-1] if lines else "no message"


def max_output_bytes() -> int:
    return limit_from_environment(OUTPUT_VARIABLE, 256) << 20


def _run_bounded(command: list[str], env: dict, binary: str, where: str) -> tuple[int, bytes, str]:
    """Run ansible-inventory, reading at most max_output_bytes() of its JSON and for at most
    TIMEOUT seconds: an inventory whose aliases multiply it costs the controller the limit, not
    its expansion. (exit status, stdout, stderr's text)."""
    limit = max_output_bytes()
    with tempfile.TemporaryFile() as errors:
        try:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            raise InventoryError(
                f"cannot run {binary}: {exc.strerror}; name ansible-core's ansible-inventory"
            ) from None
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.kill()

        timer = threading.Timer(TIMEOUT, expire)
        timer.start()
        chunks: list[bytes] = []
        size = 0
        try:
            assert proc.stdout is not None  # Popen(stdout=PIPE)
            while chunk := proc.stdout.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise InventoryError(
                        f"{binary} printed over {limit >> 20} MiB for {where} (the limit; {OUTPUT_VARIABLE} "
                        "raises it, in MiB): do YAML aliases multiply the inventory?"
                    )
                chunks.append(chunk)
            returncode = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        errors.seek(0)
        stderr = errors.read(1 << 20).decode("utf-8", "replace")
    if expired.is_set():
        raise InventoryError(f"{binary} did not answer within {TIMEOUT} s for {where}")
    return returncode, b"".join(chunks), stderr


def read_with_ansible(binary: str, *sources: Path) -> Inventory:
    command = [binary, "--list"]
    for source in sources:
        if not source.exists():
            raise InventoryError(f"inventory {source} does not exist")
        command += ["-i", str(source)]
    env = {
        **os.environ,
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    where = ", ".join(map(str, sources))
    returncode, stdout, stderr = _run_bounded(command, env, binary, where)
    if returncode != 0:
        raise InventoryError(f"ansible-inventory cannot read {where}: {_first_error(stderr)}")
    try:
        data = json.loads(stdout)
    except ValueError:
        raise InventoryError(f"{binary} --list did not print JSON for {where}; is it ansible-core's?") from None
    return from_list_output(data, f"ansible-inventory ({binary})")


def from_list_output(data: dict, reader: str) -> Inventory:
    """`ansible-inventory --list`'s JSON: groups with `hosts` and `children`, `_meta.hostvars`."""
    hostvars = (data.get("_meta") or {}).get("hostvars") or {}
    children = {g: list((body or {}).get("children") or []) for g, body in data.items() if g != "_meta"}
    direct = {g: list((body or {}).get("hosts") or []) for g, body in data.items() if g != "_meta"}
    children.setdefault("all", [])

    def descendants(name: str) -> list[str]:
        ordered, seen, level = [name], {name}, [name]
        while level:
            nxt = []
            for g in level:
                for child in children.get(g, []):
                    if child not in seen:
                        seen.add(child)
                        ordered.append(child)
                        nxt.append(child)
            level = nxt
        return ordered

    group_hosts: dict[str, list[str]] = {}
    for group in children:
        ordered: dict[str, None] = {}  # an ordered set
        for g in descendants(group):
            ordered.update(dict.fromkeys(direct.get(g, [])))
        group_hosts[group] = list(ordered)
    member: dict[str, set[str]] = {}
    for group, hosts in group_hosts.items():
        for h in hosts:
            member.setdefault(h, {"all"}).add(group)
    entries = [Entry(h, dict(hostvars.get(h) or {}), tuple(sorted(member[h]))) for h in group_hosts["all"]]
    return Inventory(entries, group_hosts, reader)
