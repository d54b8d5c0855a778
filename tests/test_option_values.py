"""Option values a person can mistype, refused as usage errors (exit 2) before anything runs
(issue 38): time limits that are not finite, positive, bounded numbers of seconds."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from patcher.cli.patcher_command import main as cli_main
from tests.support.cli import patcher
from workbench.envs import light_env

# (command, option) for every time limit the commands take
TIME_OPTIONS = [
    ("apply", "--lock-timeout"),
    ("apply", "--facts-timeout"),
    ("apply", "--write-timeout"),
    ("apply", "--verify-timeout"),
    ("status", "--facts-timeout"),
    ("plan", "--facts-timeout"),
    ("verify", "--verify-timeout"),
    ("rollback", "--lock-timeout"),
    ("rollback", "--write-timeout"),
    ("forget", "--lock-timeout"),
]
WEEK = 7 * 24 * 3600  # the longest time limit (patcher/core/errors.py MAX_SECONDS)
NOT_SECONDS = ["inf", "-inf", "1e300", "nan", "-1", "ten", str(WEEK + 1)]


@pytest.mark.parametrize(("command", "option"), TIME_OPTIONS)
def test_a_time_limit_that_is_not_a_finite_positive_bounded_number_is_a_usage_error(command: str, option: str):
    for value in [*NOT_SECONDS, *([] if option == "--lock-timeout" else ["0"])]:
        # a target that does not exist: a value taken as valid fails there (exit 2 too, another line)
        done = CliRunner().invoke(cli_main, [command, option, value, "--python", "/nonexistent/python"])
        assert done.exit_code == 2, (value, done.output)
        assert f"Invalid value for '{option}': '{value}' is not a number of seconds" in done.output, done.output
        assert "Traceback" not in done.output


def test_the_bounds_themselves_are_time_limits(tmp_path):
    python = str(light_env(tmp_path))
    code, _, err = patcher("status", "--facts-timeout", str(WEEK), "--python", python, "--json")
    assert code == 0, err
    code, _, err = patcher("apply", "--lock-timeout", "0", "--no-verify", "--python", python, "--json")
    assert code == 0, err


def test_an_infinite_time_limit_on_a_real_target_is_one_usage_line(tmp_path):
    """Once an OverflowError traceback (exit 1) from the agent's deadline."""
    python = str(light_env(tmp_path))
    for option in ("--facts-timeout", "--lock-timeout"):
        code, _, err = patcher("apply", option, "inf", "--no-verify", "--python", python)
        assert code == 2, err
        assert err.strip().splitlines()[-1].startswith(f"Error: Invalid value for '{option}': 'inf' is not"), err


def test_an_empty_python_is_a_usage_error_not_patchers_own_interpreter():
    for value in ("", " "):
        for where in ([], ["--host", "root@127.0.0.1"]):
            done = CliRunner().invoke(cli_main, ["status", "--python", value, *where])
            assert done.exit_code == 2, done.output
            assert f"Invalid value for '--python': {value!r} names no interpreter" in done.output, done.output


def test_a_fullwidth_host_name_names_the_characters_it_refuses(tmp_path):
    """Fullwidth letters are alphanumeric to Python, not to DNS or ssh: the line names each one
    (it once named none: "refusing host ...:  not allowed")."""
    code, _, err = patcher("status", "--host", "ｇｐｕ1.lab", cwd=tmp_path)
    assert code == 2, err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "refusing host 'ｇｐｕ1.lab': 'ｇ' (U+FF47), 'ｐ' (U+FF50), 'ｕ' (U+FF55) not allowed in a host name "
            "(ASCII letters, digits, '.', '_' and '-' only, not '.' or '-' first)"
        )
    ), err


REFUSED = (  # ssh options patcher's command line refuses (patcher/transport/ssh.py REFUSED_SSH_OPTIONS)
    "ProxyCommand",
    "LocalCommand",
    "PermitLocalCommand",
    "KnownHostsCommand",
    "PKCS11Provider",
    "SecurityKeyProvider",
    "BatchMode",
    "RemoteCommand",
    "SessionType",
    "RequestTTY",
    "StdinNull",
    "ForkAfterAuthentication",
)


def test_ssh_options_that_run_a_local_command_or_take_the_session_are_refused(tmp_path):
    """docs/remote.md: free-form options never come from the command line. Each is one line naming
    the option and every refused one, exit 2, before ssh runs (the ProxyCommand once ran)."""
    import shlex

    marker = tmp_path / "ran"
    command = f"touch {shlex.quote(str(marker))}"
    for number, key in enumerate(REFUSED):
        value = command if key.endswith("Command") else "yes"
        spelled = key.lower() if number % 2 else key  # ssh reads keys in any case
        code, _, err = patcher(
            "status", "--host", "root@127.0.0.1", "--ssh-option", f"{spelled}={value}", cwd=tmp_path, timeout=60
        )
        assert code == 2, (spelled, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: refusing --ssh-option {key}: it "), last
        assert "takes none of ProxyCommand, LocalCommand, PermitLocalCommand, KnownHostsCommand" in last, last
        assert not marker.exists(), spelled
    from patcher.transport.ssh import REFUSED_SSH_OPTIONS

    assert tuple(REFUSED_SSH_OPTIONS) == REFUSED
    done = CliRunner().invoke(cli_main, ["status", "--help"], terminal_width=200)
    assert "none that runs a local command or takes the session (ProxyCommand, LocalCommand" in done.output
