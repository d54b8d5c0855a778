"""An inventory cannot exhaust the controller: YAML aliases that multiply it, template chains,
groups nested thousands deep are one line each with the limit and how to raise it, under a
memory cap; a large inventory with --limit is read in linear time (measured in bench/inventory.py)."""

from __future__ import annotations

import resource
import subprocess
from pathlib import Path

from patcher.fleet.inventory import load_hosts
from tests.support.cli import patcher_argv, patcher_env

MEMORY_CAP = 2 << 30  # bytes of address space for the controller


def capped_patcher(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    return subprocess.run(
        patcher_argv(*args), capture_output=True, text=True, env=patcher_env(), preexec_fn=cap, timeout=timeout
    )


def one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, done.stderr


def laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 "lol"']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines)


def test_a_billion_laughs_through_a_connection_variable(tmp_path: Path):
    inventory = tmp_path / "laughs.yml"
    inventory.write_text(
        "all:\n  vars:\n    "
        + laughs().replace("\n", "\n    ")
        + "\n  hosts:\n    gpu1:\n      ansible_user: '{{ l9 }}'\n"
    )
    done = capped_patcher("status", "--no-ansible-inventory", "-i", str(inventory), "--python", "/usr/bin/python3")
    one_line_error(done, "expands to over 5,000,000 values", "PATCHER_INVENTORY_MAX_NODES")


def test_children_multiplied_by_aliases(tmp_path: Path):
    levels = ["g0: &g0\n  hosts:\n    gpu1:"]
    for i in range(1, 40):
        levels.append(f"g{i}: &g{i}\n  children:\n    a{i}: *g{i - 1}\n    b{i}: *g{i - 1}")
    inventory = tmp_path / "children.yml"
    inventory.write_text(
        "x-anchors:\n  " + "\n".join(levels).replace("\n", "\n  ") + "\nall:\n  children:\n    top: *g39\n"
    )
    done = capped_patcher("status", "--no-ansible-inventory", "-i", str(inventory), "--python", "/usr/bin/python3")
    one_line_error(done, "expands to over", "PATCHER_INVENTORY_MAX_NODES")


def test_groups_nested_thousands_deep(tmp_path: Path):
    ini = tmp_path / "deep.ini"
    ini.write_text("".join(f"[g{i}:children]\ng{i + 1}\n" for i in range(3000)) + "[g3000]\ngpu1\n")
    one_line_error(
        capped_patcher("status", "--no-ansible-inventory", "-i", str(ini), "--python", "/usr/bin/python3"),
        "groups deep, over the limit of 100",
        "PATCHER_INVENTORY_MAX_DEPTH",
    )
    yml = tmp_path / "deep.yml"
    body, indent = "", ""
    for i in range(3000):
        body += f"{indent}g{i}:\n{indent}  children:\n"
        indent += "    "
    yml.write_text("all:\n  children:\n" + "\n".join("  " + line for line in body.splitlines()) + "\n")
    done = capped_patcher("status", "--no-ansible-inventory", "-i", str(yml), "--python", "/usr/bin/python3")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "deep" in done.stderr.strip().splitlines()[-1], done.stderr


def test_limit_one_host_of_a_large_inventory(tmp_path: Path):
    ini = tmp_path / "big.ini"
    ini.write_text(
        "[gpus]\n"
        + "".join(f"gpu{i:05d} ansible_host=127.0.0.{i % 200 + 2}\n" for i in range(20000))
        + "[gpus:vars]\nansible_user=ops\n"
    )
    loaded = load_hosts([], [str(ini)], "gpu00007")
    assert [(h.name, h.address, h.user) for h in loaded.hosts] == [("gpu00007", "127.0.0.9", "ops")]
    loaded = load_hosts([], [str(ini)], "gpus[3:5],!gpu00004")
    assert [h.name for h in loaded.hosts] == ["gpu00003", "gpu00005"]
