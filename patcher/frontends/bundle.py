"""`patcher bundle -o FILE`: one self-contained Python file (standard library only) for hosts the
controller cannot reach. Copy it there (scp, a container image) and run it with the target
environment's Python: `/root/ml-env/bin/python3 patcher-bundle.py status|plan|apply|rollback`.

What goes in:
- the agent (remote/agent/) and the shared modules (patcher/core/errors.py and versions.py,
  patcher/plan/planning.py), as
  module texts imported from memory as an agent imports them: it does every write, as when
  patcher drives it, and plans and selects with patcher's own code;
- the patches' declarations (ids, conditions, edits' conditions, needs, verification calls);
- for every pristine file patcher knows — the target files of the releases the patches are
  written for, taken from the release wheels (the package index, or a cache, or --wheel) and
  known by sha256 — the patched bytes for every patch selection that some version of the
  conditioned distributions (vLLM) leads to. They are found by probing versions around every
  boundary the conditions name (each boundary's .dev0, a1, rc1, itself, +local, .post1, the
  next patch and minor release), selecting with patcher's own selection, and transforming
  with patcher's own codemods: the same bytes patcher would write.

Versions are matched by patcher/core/versions.py, patcher's own PEP 440 (the controller's too); it
is checked here against `packaging`, the reference, on every condition and every probe, and the
bundle is not written if they disagree anywhere. A version whose selection the bundle holds no bytes for,
and a file whose bytes it does not know, are refused on the host with a clear message.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import itertools
import json
import re
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet

from .. import __version__
from ..model import Patch, ReleaseLine
from ..plan import planning as core
from ..plan.planning import condition_names, detected_names
from ..plan.selection import condition_holds, select_patches
from ..plan.target_plan import run_transform, spec_of, specs_of
from ..transform.transforms import shared_transforms

if TYPE_CHECKING:
    from ..core.protocol import FileFacts, PlanningFacts


class BundleError(RuntimeError):
    pass


def _blob(data: bytes) -> str:
    import zlib

    return base64.b64encode(zlib.compress(data, 9)).decode("ascii")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------ releases and their files


def default_releases(patches: Sequence[Patch], lines: Sequence[ReleaseLine] = ()) -> list[tuple[str, str]]:
    """The releases the patches are written for: every release of the patched release lines (their
    files are what the bundle knows), else each target distribution's lower bounds."""
    found: list[tuple[str, str]] = [(x.distribution, v) for x in lines if x.patched for v in x.releases]
    if found:
        return found
    for patch in patches:
        name = patch.target.distribution
        spec = patch.requires.get(name)
        if not spec:
            continue
        for item in SpecifierSet(spec):
            if item.operator in (">=", "==", "~=") and (name, item.version) not in found:
                found.append((name, item.version))
    return found


_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-")


def pristine_files(wheels: Sequence[Path], patches: Sequence[Patch]) -> dict[str, dict[str, tuple[bytes, str, str]]]:
    """path -> sha256 -> (bytes, distribution name, release version)."""
    wanted: dict[str, set[str]] = {}
    for patch in patches:
        wanted.setdefault(patch.target.distribution.lower().replace("-", "_"), set()).add(patch.target.path)
    out: dict[str, dict[str, tuple[bytes, str, str]]] = {}
    for wheel in wheels:
        m = _WHEEL_NAME.match(Path(wheel).name)
        if not m:
            raise BundleError(f"{wheel}: not a wheel file name")
        name, version = m.group("name").lower(), m.group("version")
        paths = wanted.get(name)
        if not paths:
            raise BundleError(f"{wheel}: no patch targets {name}")
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for path in sorted(paths):
                if path in names:
                    data = archive.read(path)
                    out.setdefault(path, {})[_sha(data)] = (data, name, version)
    if not out:
        raise BundleError("none of the wheels carries a file the patches rewrite")
    return out


# ------------------------------------------------------------------ versions to probe


def _all_specs(patches: Sequence[Patch]) -> dict[str, set[str]]:
    specs: dict[str, set[str]] = {}
    for patch in patches:
        for name, spec in patch.requires.items():
            specs.setdefault(name, set()).add(spec)
        for edit in patch.edits:
            for name, spec in edit.when.items():
                specs.setdefault(name, set()).add(spec)
    return specs


def probe_versions(specs: set[str], extra: Sequence[str] = ()) -> list[str]:
    from packaging.version import Version

    bounds = set(extra)
    for spec in specs:
        for item in SpecifierSet(spec):
            bounds.add(item.version.removesuffix(".*"))
    probes = {"0.0.1", "999.0"}
    for text in bounds:
        v = Version(text)
        base = v.base_version
        release = list(v.release) + [0] * (3 - len(v.release))
        probes |= {
            text,
            base,
            f"{base}.dev0",
            f"{base}a1",
            f"{base}rc1",
            f"{base}rc1.dev1",
            f"{base}+local",
            f"{base}.post1",
            f"{base}.post1.dev0",
            f"{base}.1",
            ".".join(map(str, release[:-1] + [release[-1] + 1])),
            ".".join(map(str, [release[0], release[1] + 1, 0])),
            ".".join(map(str, [release[0], release[1] + 1, 0])) + "rc1",
        }
        if release[-1] > 0:
            probes.add(".".join(map(str, release[:-1] + [release[-1] - 1])))
    return sorted(probes, key=Version)


def check_runtime_versions(specs: dict[str, set[str]], probes: dict[str, list[str]]) -> int:
    """patcher's PEP 440 (patcher/core/versions.py) against packaging's, everywhere the bundle's
    selection depends on it. Returns checks made."""
    from packaging.specifiers import InvalidSpecifier
    from packaging.version import InvalidVersion, Version

    def packaging_holds(spec: str, version: str) -> bool:
        try:
            return SpecifierSet(spec, prereleases=True).contains(Version(version), prereleases=True)
        except (InvalidSpecifier, InvalidVersion):
            return False

    checks = 0
    for name, spec_set in specs.items():
        for spec in spec_set:
            for version in probes[name]:
                ours, theirs = condition_holds(spec, version), packaging_holds(spec, version)
                checks += 1
                if ours != theirs:
                    raise BundleError(
                        f"patcher's version logic says {version} {'satisfies' if ours else 'does not satisfy'} "
                        f"{spec!r}, packaging says the opposite; not writing a bundle that would select wrongly"
                    )
    return checks


# ------------------------------------------------------------------ the bundle


def _patch_data(patches: Sequence[Patch]) -> list[dict]:
    """The declarations as the shared planning core reads them (and the title, for `info`)."""
    return [{**spec_of(p).as_json(), "title": p.title} for p in patches]


def _facts(versions: dict, present: dict[str, bytes], patches: Sequence[Patch]) -> PlanningFacts:
    """What the agent would report for an environment holding these pristine files."""
    files: dict[str, FileFacts] = {}
    for target in {p.target.path: p.target for p in patches}.values():
        data = present.get(target.path)
        if data is None:
            files[target.path] = {"exists": False}
            continue
        sha = _sha(data)
        files[target.path] = {
            "exists": True,
            "root": "/bundle",
            "sha256": sha,
            "record_sha256": sha,
            "content": data.decode("utf-8"),
            "writable": True,
        }
    return {
        "distributions": {
            name: {"name": name, "version": version, "location": "/bundle"} for name, version in versions.items()
        },
        "files": files,
        "state": {"files": {}},
        "state_error": None,
    }


def _regions(probes: dict[str, list[str]], specs: dict[str, set[str]]) -> dict[str, list[str]]:
    """Per name, one probe for each distinct answer of that name's conditions: a selection depends
    on a version only through them, and the product over names must stay small (four detected
    distributions with dozens of probes each would be millions of selections)."""
    kept: dict[str, list[str]] = {}
    for name, versions in probes.items():
        conditions = sorted(specs.get(name, set()))
        seen: dict[tuple, str] = {}
        for version in versions:
            seen.setdefault(tuple(condition_holds(c, version) for c in conditions), version)
        kept[name] = list(seen.values())
    return kept


def _selections(patches: Sequence[Patch], names: list[str], probes: dict[str, list[str]]) -> list[dict]:
    """One set of versions for every distinct patch selection the probed versions lead to."""
    specs = specs_of(patches)
    found: dict[str, dict] = {}
    for values in itertools.product(*(probes[n] for n in names)):
        versions = dict(zip(names, values))
        chosen = core.select(specs, versions, condition_holds)
        key = json.dumps([[pid, chosen[pid].edits] for pid in core.selected_with_needs(specs, chosen)])
        found.setdefault(key, versions)
    return list(found.values())


def _variants(
    patches: Sequence[Patch], files: dict[str, dict[str, tuple[bytes, str, str]]], selections: list[dict]
) -> tuple[dict, dict]:
    """(transform key -> result, sha256 -> compressed bytes): for every release's pristine files
    and every selection, each transform the shared planning core asks for, run here with
    patcher's own codemods: the same results a run of patcher would plan with."""
    by_id = {p.id: p for p in patches}
    specs = specs_of(patches)
    releases: dict[tuple[str, str], dict[str, bytes]] = {}  # a release's pristine files, together
    for path, per_sha in files.items():
        for data, dist, version in per_sha.values():
            releases.setdefault((dist, version), {})[path] = data
    variants: dict[str, dict] = {}
    blobs: dict[str, str] = {}
    with shared_transforms():
        for versions in selections:
            for present in releases.values():
                draft = core.draft(_facts(versions, present, patches), specs, condition_holds, "apply")
                for request in draft.requests:
                    if request.key() in variants:
                        continue
                    result = run_transform(request, by_id)
                    entry: dict = {"outcomes": result.outcomes, "missing": [list(m) for m in result.missing]}
                    if not result.missing:
                        new = result.content.encode("utf-8")
                        blobs.setdefault(_sha(new), _blob(new))
                        entry["sha256"] = _sha(new)
                    variants[request.key()] = entry
    return variants, blobs


def build(
    patches: Sequence[Patch],
    wheels: Sequence[Path],
    progress: Callable[[str], None] = lambda message: None,
    lines: Sequence[ReleaseLine] = (),
) -> tuple[str, dict]:
    """The bundle's source text and a summary of what it carries; `lines`, the release lines a target
    must be on (patcher.patchset.registry.release_lines), are checked on the host as patcher checks them."""
    files = pristine_files(wheels, patches)
    names = condition_names(patches)
    specs = _all_specs(patches)
    releases = {
        name: sorted({v for per in files.values() for (_, d, v) in per.values() if d == name}) for name in names
    }
    probes = {name: probe_versions(specs.get(name, set()), releases.get(name, [])) for name in names}
    checks = check_runtime_versions(specs, probes)
    progress(f"version logic checked against packaging: {checks} condition/version pairs")
    selections = _selections(patches, names, _regions(probes, specs))
    variants, blobs = _variants(patches, files, selections)
    originals = {
        path: {sha: {"release": f"{dist} {version}"} for sha, (_, dist, version) in per_sha.items()}
        for path, per_sha in files.items()
    }
    progress(
        f"{len(variants)} patched variant(s) of {sum(len(v) for v in originals.values())} pristine file(s), "
        f"for {len(selections)} patch selection(s)"
    )
    data = {
        "format": 2,
        "patcher_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "names": detected_names(patches),
        "files": [
            {"distribution": p.target.distribution, "path": p.target.path, "module": p.target.module}
            for p in {p.target.path: p for p in patches}.values()
            if p.target.path in files
        ],
        "patches": _patch_data(patches),
        "lines": [x.as_json() for x in lines],
        "originals": originals,
        "variants": variants,
        "blobs": blobs,
        "ranges": _ranges(patches, names, probes, files),
    }
    source = _render(data)
    summary = {
        "files": {path: sorted(per) for path, per in originals.items()},
        "variants": len(variants),
        "selections": len(selections),
        "bytes": len(source.encode("utf-8")),
        "checks": checks,
    }
    return source, summary


def _ranges(patches: Sequence[Patch], names: list[str], probes: dict[str, list[str]], files) -> list[str]:
    """Human lines: for each release of the target distribution, which patches each range of
    the other distributions' versions selects (for `bundle.py info`)."""
    from packaging.version import Version

    lines = []
    targets = {p.target.distribution for p in patches}
    releases = sorted({(d, v) for per in files.values() for (_, d, v) in per.values()})
    others = [n for n in names if n not in targets]
    for dist, version in releases:
        for other in others:
            groups: list[tuple[str, str]] = []  # (first version, selection)
            for probe in sorted(probes[other], key=Version):
                chosen = select_patches(patches, {dist: version, other: probe})
                sel = ", ".join(p.short_id for p in patches if chosen[p.id].selected) or "nothing"
                if not groups or groups[-1][1] != sel:
                    groups.append((probe, sel))
            for i, (start, sel) in enumerate(groups):
                bounds = [f">= {start}"] if i else []
                if i + 1 < len(groups):
                    bounds.append(f"< {groups[i + 1][0]}")
                lines.append(f"{dist} {version}, {other} {' and '.join(bounds) or 'any'}: {sel}")
    return lines


# The modules of patcher's a bundle runs besides the agent and what it imports, named from `patcher`.
BUNDLE_SHARED_MODULES = ("plan.planning", "core.versions")


def _render(data: dict) -> str:
    from ..transport.interface import agent_bootstrap
    from . import bundle_runtime

    runtime = Path(bundle_runtime.__file__).read_text(encoding="utf-8")
    # The agent and the shared core, as module texts: the bundle runs patcher's own code, not a copy.
    modules = agent_bootstrap().read_texts(BUNDLE_SHARED_MODULES)
    contents = {
        "DATA": json.dumps(data, sort_keys=True).encode("utf-8"),
        "MODULES": json.dumps(modules, sort_keys=True).encode("utf-8"),
    }
    digests = {name: _sha(value) for name, value in contents.items()}
    marker = "\nDIGESTS = None"
    if marker not in runtime:
        raise BundleError("bundle_runtime.py has no `DIGESTS = None` line")
    runtime = runtime.replace(marker, f"\nDIGESTS = {json.dumps(digests, sort_keys=True)}", 1)
    for name, value in ((name, _blob(content)) for name, content in contents.items()):
        marker = f"\n{name} = None"
        if marker not in runtime:
            raise BundleError(f"bundle_runtime.py has no `{name} = None` line")
        wrapped = "\n".join(value[i : i + 100] for i in range(0, len(value), 100))
        runtime = runtime.replace(marker, f'\n{name} = """\n{wrapped}\n"""', 1)
    program = runtime + '\n\nif __name__ == "__main__":\n    sys.exit(main())\n'
    return seal(_header(data), program)


# A bundle is Python whose every prefix is harmless: the loader below is one `try` statement (cut
# anywhere inside it, the file does not compile and nothing runs), and the program it runs follows
# as comment lines (cut anywhere there, the file still compiles, so the loader runs first and finds
# the last line missing). The last line holds the sha256 of every byte above it; the loader reads
# the file, checks it, and only then compiles the program from the lines it checked.
PROGRAM_MARK = "# patcher bundle program (each line below, after its '# '):"
TRAILER = "# end of patcher bundle, sha256 of every byte above: "
_LOADER = """\
    # The loader is one `try` statement: a bundle cut inside it does not compile, so none of it runs.
    import sys

    # Python puts this file's folder first on sys.path (unless -I or -P): a json.py beside it
    # would run before the bundle's own code. Nothing is imported before that folder is gone.
    if not (getattr(sys.flags, "isolated", 0) or getattr(sys.flags, "safe_path", 0)) and sys.path:
        del sys.path[0]
    import hashlib

    def _refuse(why, fix="make a new one with `patcher bundle` and copy it whole"):
        sys.stderr.write(f"error: this bundle {why}: {fix}\\n")
        sys.exit(2)  # EXIT_USAGE (patcher/core/errors.py)

    if not globals().get("__file__"):  # python3 - < bundle: nothing to read back
        _refuse("cannot check its own bytes from standard input", "run it as a file: python3 patcher-bundle.py status")
    with open(__file__, "rb") as _file:
        _raw = _file.read()
    _end = _raw.rfind(b"\\n" + TRAILER_BYTES) + 1
    _trailer = _raw[_end + len(TRAILER_BYTES) :]
    if not _end or len(_trailer) != 65 or not _trailer.endswith(b"\\n"):
        _refuse("is incomplete (its last line, the sha256 of the rest, is missing: the copy was cut short)")
    if hashlib.sha256(_raw[:_end]).hexdigest().encode() != _trailer[:64]:
        _refuse("is damaged (its bytes do not match the sha256 its last line gives)")
    _lines = _raw[:_end].decode("utf-8").split("\\n")
    _first = _lines.index(PROGRAM_MARK) + 1
    _program = "\\n" * _first + "\\n".join(line[2:] for line in _lines[_first:])
    del _file, _raw, _end, _trailer, _lines
    _code = compile(_program, __file__, "exec")  # line numbers are the file's: tracebacks point into it
    exec(_code)  # noqa: S102 - the program this file carries, checked whole above
finally:
    ...  # `...`, not `pass`: a file cut inside `pass` would run a name and hide the refusal above
"""


def _header(data: dict) -> str:
    """The shebang and the opening of the loader's statement, with what the file is."""
    return (
        "#!/usr/bin/env python3\n"
        f"try:  # patcher bundle, made by patcher {data['patcher_version']} on {data['created']}.\n"
        "    # Run it with the target environment's Python, e.g.:\n"
        "    #   /root/ml-env/bin/python3 patcher-bundle.py status   (then plan, apply, rollback; info)\n"
        "    # Standard library only; nothing is installed. Generated: do not edit.\n"
    )


def seal(header: str, program: str) -> str:
    """The bundle file: `header` (the shebang, `try:` and comments), the loader, `program` as comment
    lines, and the trailer that proves the file whole."""
    loader = _LOADER.replace("TRAILER_BYTES", repr(TRAILER.encode())).replace("PROGRAM_MARK", repr(PROGRAM_MARK))
    body = header + loader + PROGRAM_MARK + "\n"
    body += "".join(f"# {line}\n" if line else "#\n" for line in program.split("\n"))
    return body + TRAILER + hashlib.sha256(body.encode("utf-8")).hexdigest() + "\n"


def program_of(source: str) -> str:
    """The program a bundle file carries (for the tests, which edit it and seal it again: `reseal`)."""
    lines = source.split("\n")
    body = lines[lines.index(PROGRAM_MARK) + 1 : -2]
    return "\n".join(line[2:] for line in body)


def reseal(source: str, program: str) -> str:
    """`source`, a bundle file, carrying `program` instead, with a trailer that matches it."""
    return seal(source[: source.index(_LOADER.split("\n", 1)[0])], program)


def write(output: Path, source: str) -> None:
    from ..output_files import write_output_file

    write_output_file(output, source.encode("utf-8"), 0o755)
