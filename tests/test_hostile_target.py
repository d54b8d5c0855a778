"""What a hostile target says never acts on the controller: a host whose Python answers with
line separators, control characters and terminal escapes in its failure message (a compromised
host, or a target environment's owner through a `.pth` file) can neither plant a host in the
retry file patcher writes nor move the operator's cursor.

The target here is a real sshd on loopback and a "python" that speaks patcher's protocol (it reads
the session's mark from the first line, as the agent does) and answers every request with a
failure carrying the payload.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.fleet.inventory import read_inventory
from tests.support.cli import patcher, timed_patcher
from workbench.sshd import spec, why_no_sshd

pytestmark = pytest.mark.skipif(why_no_sshd() is not None, reason=why_no_sshd() or "")
patcher = functools.partial(patcher, clean_ssh=True)
timed_patcher = functools.partial(timed_patcher, clean_ssh=True)

# Every character that str.splitlines() or ansible's INI reader take as the end of a line, and
# what a terminal acts on (ESC, BEL, CR, backspace, a bidi override).
BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
TERMINAL = ["\x1b[2J\x1b]0;owned\x07", "\x08", "\u202e"]


def planted_host(marker: Path) -> str:
    """An inventory line that, read as one, runs a command on the controller when ssh starts."""
    return f"pwned ansible_host=127.0.0.2 ansible_ssh_common_args='-oProxyCommand=\"touch {marker}\"'"


def hostile_python(folder: Path, message: str) -> Path:
    """An executable that answers patcher's first request (and every later one) with `message`."""
    script = folder / "answer.py"
    script.write_text(
        "import json, sys\n"
        "mark = json.loads(sys.stdin.readline())['mark']\n"
        f"message = json.loads({json.dumps(json.dumps(message))})\n"
        "while True:\n"
        "    print(mark, json.dumps({'ok': False, 'error': {'kind': 'failed', 'message': message}}), flush=True)\n"
        "    if not sys.stdin.readline():\n"
        "        break\n"
    )
    python = folder / "python3"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(0o755)
    return python


@pytest.mark.parametrize("separator", BREAKS, ids=[f"U+{ord(c):04X}" for c in BREAKS])
def test_a_targets_message_cannot_plant_a_host_in_the_retry_file(tmp_path: Path, client, servers, separator: str):
    marker = tmp_path / "PWNED"
    message = f"x{separator}{planted_host(marker)}{separator}"
    python = hostile_python(tmp_path, message)
    server = servers()
    retry = tmp_path / "failed.retry"

    code, _doc, err = patcher(
        "status", "--host", spec(server), "--python", str(python), *client.args(), "--retry-file", str(retry)
    )
    assert code != 0, err
    # the retry the last line suggests runs nothing on the controller
    code, _doc, err = patcher("status", "-i", str(retry), *client.args(), "--no-retry-file")
    assert not marker.exists(), err
    text = retry.read_text(encoding="utf-8")
    assert separator not in text
    # patcher's own reader and ansible's: the one failed host, nothing planted
    assert [h.name for h in read_inventory(retry)] == [spec(server)]
    if shutil.which("ansible-inventory") or (Path(sys.executable).parent / "ansible-inventory").exists():
        listed = subprocess.run(
            [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(retry), "--list"],
            capture_output=True,
            text=True,
        )
        assert listed.returncode == 0, listed.stderr
        groups = json.loads(listed.stdout)
        hosts = sorted({h for name, group in groups.items() if name != "_meta" for h in group.get("hosts", [])})
        assert hosts == [spec(server)], (hosts, text)


def test_a_targets_message_reaches_the_terminal_escaped(tmp_path: Path, client, servers):
    message = "bad" + "".join(TERMINAL + BREAKS) + "end"
    python = hostile_python(tmp_path, message)
    server = servers()
    second = servers()
    for command in (
        ["status", "--host", spec(server), "--python", str(python)],  # one host: its report
        ["status", "--host", spec(server), "--host", spec(second), "--python", str(python)],  # the fleet summary
    ):
        code, _doc, err = patcher(*command, *client.args(), "--no-retry-file")
        assert code != 0, err
        for raw in {ch for ch in message if not ch.isprintable()}:
            assert raw not in err, (repr(raw), err)
        assert "\\x1b[2J" in err and "\\u2028" in err, err  # shown, as escapes
        code, doc, err = patcher(*command, *client.args(), "--no-retry-file", "--json")
        assert all(message in t["message"] for t in doc["targets"]), doc  # the JSON keeps the words exactly


def test_a_target_printing_without_end_holds_no_deadline_over_ssh(tmp_path: Path, client, servers):
    """A host whose "python" prints without end and never answers: the flood comes through ssh,
    the deadline holds (connect allowance plus --facts-timeout), and with the default noise limit
    the session ends at 1 MiB."""
    flood = tmp_path / "python3"
    flood.write_text("#!/bin/sh\nexec yes\n")
    flood.chmod(0o755)
    server = servers()
    common = ["apply", "--no-verify", "--host", spec(server), "--python", str(flood), *client.args(), "--no-retry-file"]
    limits = ["--connect-timeout", "5", "--facts-timeout", "1", "--lock-timeout", "0"]
    for env, expected in (({"PATCHER_NOISE_LIMIT_MIB": "100000"}, 4), ({}, 2)):
        code, _doc, err, took = timed_patcher(*common, *limits, env=env)
        assert code == expected, (env, err)
        assert took < 15, f"{env}: took {took:.1f}s for --connect-timeout 5 --facts-timeout 1 --lock-timeout 0"
