"""What a person reads on stderr, line for line (issue 29, "a user's first hour"): each line says
what happened and what to do next, with one prefix, on the real command line and a light target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from patcher.plan.planning import readable_conditions
from tests.support.cli import run_patcher
from workbench.envs import light_env


@pytest.fixture
def python(tmp_path: Path) -> str:
    return str(light_env(tmp_path))


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_a_second_rollback_says_nothing_is_applied(python: str):
    assert run_patcher("apply", "--no-verify", "--python", python).returncode == 0
    assert run_patcher("rollback", "--python", python).returncode == 0
    again = run_patcher("rollback", "--python", python)
    assert again.returncode == 0, again.stderr
    assert (
        last_line(again.stderr) == "ok: nothing to do: no selected patch is applied, so there is nothing to roll back"
    )
    assert "already in place" not in again.stderr
    assert "--only/--skip" not in again.stderr  # none was given
    assert "selected; not applied" in again.stderr


def test_only_names_only_when_given(python: str):
    done = run_patcher("plan", "--only", "v10", "--python", python)
    # the table wraps its last column at the console's width (80 in a pipe): read it as words
    assert "selected; left out by --only/--skip" in " ".join(done.stderr.split()), done.stderr


def test_plan_with_changes_pending_says_pending_not_ok(python: str):
    done = run_patcher("plan", "--diff", "--python", python)
    assert done.returncode == 6, done.stderr
    assert last_line(done.stderr) == "pending: 2 file(s) would change"
    assert not any(line.startswith("ok:") for line in done.stderr.splitlines())
    assert done.stdout.startswith("--- ")  # the diff, on stdout


def test_an_unreadable_target_is_one_line_with_one_prefix():
    done = run_patcher("status", "--python", "/nonexistent/bin/python3")
    lines = [x for x in done.stderr.splitlines() if not x.endswith("reading installed versions and target files")]
    assert lines == [
        "failed: /nonexistent/bin/python3 does not exist; name the environment's interpreter with --python PATH"
    ], done.stderr


def test_verify_on_unpatched_files_names_apply(python: str):
    done = run_patcher("verify", "--python", python)
    assert done.returncode == 1
    assert "`patcher apply` applies them and verifies again" in done.stderr, done.stderr


def test_apply_says_when_it_verifies(python: str):
    done = run_patcher("apply", "--python", python, "--json")
    assert "then verifying them in a fresh interpreter" in done.stderr, done.stderr
    assert done.stdout.lstrip().startswith("{")  # --json: stdout is the document alone
    quiet = run_patcher("rollback", "--python", python, "--quiet")
    assert "verifying" not in quiet.stderr and "writing" not in quiet.stderr


def test_conditions_render_once_and_readably(python: str):
    status = run_patcher("status", "--python", python).stderr
    listed = run_patcher("list").stderr
    for text in (status, listed):
        for raw in (">=0.12.0, >=0.12.0", ">=0.11.1, >=0.11.0", "<=0.18.0,!=0.18.0", ">=0.11.1, >=0.12.0"):
            assert raw not in text.replace("\n", " "), raw
    assert "speculators >=0.3.0, <0.4.0; vllm >=0.12.0" in listed


def reasons(done) -> dict[str, str]:
    return {p["id"]: p["reason"] for p in json.loads(done.stdout)["targets"][0]["patches"]}


def test_a_reason_names_each_distribution_once_in_a_readable_range(tmp_path: Path):
    """v3's edits need vllm >=0.11.1 or >=0.12.0, v14's >=0.29.0 or >=0.33.0: one range each."""
    done = run_patcher("status", "--python", str(light_env(tmp_path, vllm="0.11.0")), "--json")
    why = reasons(done)
    assert why["v3-signatures"] == "no edit applies: vllm 0.11.0 does not satisfy >=0.11.1"
    assert why["v14-kv-cache-layout"] == "no edit applies: vllm 0.11.0 does not satisfy >=0.29.0"
    assert why["v22-result-order"] == "speculators 0.3.0 does not satisfy >=0.4.0, <0.5.0"


def test_no_patch_selected_says_each_missing_distribution_once(tmp_path: Path):
    done = run_patcher("status", "--python", str(light_env(tmp_path, vllm=None)), "--json")
    assert done.returncode == 0, done.stderr
    why = reasons(done)
    assert why["v17-attn-mask-utils"] == "no edit applies: transformers is not installed (needs >=5.24.0, <5.25.0)"
    assert why["v18-lazy-compile"] == (
        "no edit applies: torch is not installed (needs >=2.0); vllm is not installed (needs >=0.11.0)"
    )
    # its two edits together take any vllm: only that vllm is missing is worth saying
    assert why["v20-wrapper-decoder"] == "no edit applies: vllm is not installed"
    assert last_line(done.stderr) == (
        "ok: no patch selected: speculators 0.3.0 does not satisfy >=0.4.0, <0.5.0; torch is not installed; "
        "transformers is not installed; vllm is not installed"
    )


def test_readable_conditions():
    assert readable_conditions({"vllm": ">=0.12.0"}, [{"vllm": ">=0.12.0"}]) == {"vllm": ">=0.12.0"}
    assert readable_conditions({}, [{"vllm": ">=0.11.1"}, {"vllm": ">=0.11.0"}]) == {"vllm": ">=0.11.0"}
    assert readable_conditions({}, [{"vllm": "<=0.18.0,!=0.18.0"}]) == {
        "vllm": "<0.18.0 (0.18.0 pre-releases included)"
    }
    assert readable_conditions({"vllm": ">=0.11.0"}, [{"vllm": "<=0.18.0,!=0.18.0"}]) == {
        "vllm": ">=0.11.0, <0.18.0 (0.18.0 pre-releases included)"
    }
    # an edit that does not look at vllm lets any vllm through: vllm does not limit the patch
    assert readable_conditions({"speculators": ">=0.3.0,<0.4.0"}, [{"vllm": ">=0.12.0"}, {}]) == {
        "speculators": ">=0.3.0, <0.4.0"
    }
    assert readable_conditions({}, [{"vllm": ">=0.11"}, {"vllm": ">=0.13,<0.14"}, {"vllm": ">=0.20"}]) == {
        "vllm": ">=0.11"
    }
    assert readable_conditions({}, [{"x": ">=1,<2"}, {"x": ">=3"}]) == {"x": ">=1, <2 or >=3"}
    assert readable_conditions({"x": "~=1.2"}, []) == {"x": "~=1.2"}  # not a plain interval: as written


def test_list_at_80_columns_keeps_ids_whole():
    done = run_patcher("list", env={"COLUMNS": "80"})
    lines = done.stderr.splitlines()
    ids = [p.id for p in load_patches()]
    assert [x for x in lines if not x.startswith(" ")] == ids
    assert all(len(x) <= 80 or " " not in x.strip() for x in lines)


def test_an_expected_failure_in_the_e2e_report_is_one_readable_line():
    """tests/test_e2e_vllm.py's report, printed on a passing run, states the failures its tests
    require: each on one line, without pydantic's link and detail or vLLM's pointer to a stack
    trace (the messages as the extraction driver recorded them on vLLM 0.16.0)."""
    from tests.support.e2e import summary

    pristine = {
        "type": "ValidationError",
        "phase": "init",
        "where": "_dataclasses.py:__init__",
        "message": "1 validation error for SchedulerConfig\nis_encoder_decoder\n  Field required [type=missing, "
        "input_value=ArgsKwargs((), {'max_num_..._batched_tokens': 8192}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.12/v/missing",
    }
    assert summary({"error": pristine}) == (
        "ValidationError in init at _dataclasses.py:__init__: 1 validation error for SchedulerConfig; "
        "is_encoder_decoder; Field required"
    )
    without_v6 = {
        "type": "RuntimeError",
        "phase": "generate 1",
        "where": "multiproc_executor.py:get_response",
        "message": "Worker failed with error 'request req_0_3: captured 32 rows of hidden states, expected 64', "
        "please check the stack trace above for the root cause",
    }
    assert summary({"error": without_v6}) == (
        "RuntimeError in generate 1 at multiproc_executor.py:get_response: Worker failed with error "
        "'request req_0_3: captured 32 rows of hidden states, expected 64'"
    )
    bare = {"type": "AssertionError", "phase": "generate 1", "where": "block_pool.py:cache_full_blocks", "message": ""}
    assert summary({"error": bare}) == "AssertionError in generate 1 at block_pool.py:cache_full_blocks"
