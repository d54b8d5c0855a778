"""Download the pinned wheels of vLLM releases here and cut them into folders the device tool can carry.

    python bench/gpu/fetch.py 0.20.0 [0.20.1 ...] [--dest DIR]  # download, cut into folders
    python bench/gpu/fetch.py --run-only [--dest DIR]  # only refresh DEST/run (scripts + patcher)
    python bench/gpu/fetch.py --run-only --speculators 0.4.0.1  # DEST/run also holds that release


The GPU machine has no network and a call carries at most 64 MiB, so everything it needs travels
in folders that fit a call beside the checkout (`DEST/stage-0.20.0/00`, `01`, ...; `stage-0.20.1+0.20.2/` for
several releases, each shared wheel once): large wheels cut into parts, small ones packed
together, and `manifest.json` beside them giving each release's wheels, each wheel's sha256 and
the parts it is cut into, so `gpu_run.py` can join them and check every byte before installing.
`DEST/run` holds gpu_run.py, kv_probe.py, workbench/tiny_moe.py (the tiny MoE checkpoints' builder) and a
patcher wheel built from this checkout (`pip wheel --no-deps`);
it is small and is carried with the call that runs, so a change to patcher needs no new staging.

DEST defaults to `.gpu` in the repository the device tool sends (ignored by git there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CALL_BYTES = 64 * 2**20  # what one call carries: the checkout's tracked files and the carried paths
SPARE = 4 * 2**20  # for DEST/run (under 1 MiB), the files a change adds, and a record or two


def part_bytes() -> int:
    """The largest staged folder one call carries beside this checkout's tracked files (51 MiB on
    2026-12-05, less as the GPU records grow), in whole MiB."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tracked = sum(
        path.stat().st_size for name in listed.split(b"\0") if name and (path := REPO / name.decode()).is_file()
    )
    return (CALL_BYTES - tracked - SPARE) // 2**20 * 2**20


# The GPU machine: Python 3.12, x86_64, glibc new enough for manylinux_2_35 (vLLM's CUDA wheels).
PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_35_x86_64",
    "--platform",
    "manylinux_2_31_x86_64",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_27_x86_64",  # triton 3.8, nvidia-cudnn-cu13
    "--platform",
    "manylinux_2_24_x86_64",
    "--platform",
    "manylinux_2_18_x86_64",  # nvidia-nccl-cu13 2.30
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pinned(release: str) -> Path:
    listing = HERE / f"vllm-{release}.txt"
    if not listing.is_file():
        known = ", ".join(sorted(p.stem.removeprefix("vllm-") for p in HERE.glob("vllm-*.txt")))
        sys.exit(f"no wheel list bench/gpu/vllm-{release}.txt; known releases: {known}")
    return listing


def download(listing: Path, wheels: Path) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM, "-d", str(wheels), "-r", str(listing)]
    if subprocess.run(command).returncode != 0:
        sys.exit(f"pip download failed for {listing.name} (see pip's message above)")


def pack_run(run: Path, speculators: str | None) -> None:
    """DEST/run: the script the device runs, this checkout's patcher as a wheel and, where asked,
    another speculators release (gpu_run.py --speculators installs it instead of the staged one)."""
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    shutil.copy2(HERE / "gpu_run.py", run / "gpu_run.py")
    shutil.copy2(HERE / "kv_probe.py", run / "kv_probe.py")  # the KV cache probe (v28), run after it
    shutil.copy2(REPO / "workbench" / "tiny_moe.py", run / "tiny_moe.py")  # gpu_run.py --models makes them
    # From the tracked files only: a build/ folder left by an earlier build would put modules
    # that no longer exist (a renamed patch) into the wheel.
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory() as clean:
        for name in filter(None, listed.decode().split("\0")):
            source = REPO / name
            if source.is_file():
                (Path(clean) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, Path(clean) / name)
        patcher = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(run), clean]
        if subprocess.run(patcher).returncode != 0:
            sys.exit("pip wheel of this checkout failed")
    if speculators:
        wanted = [f"speculators=={speculators}"]
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *PLATFORM, "-d", str(run), *wanted]
        if subprocess.run(command).returncode != 0:
            sys.exit(f"pip download speculators=={speculators} failed (see pip's message above)")


def stage(wheel_sets: dict[str, list[Path]], out: Path) -> dict:
    """Fill out/00, out/01, ... (each at most part_bytes()) with every release's wheels, each wheel
    once (releases share most of them), and return the manifest."""
    part = part_bytes()
    if out.exists():
        shutil.rmtree(out)
    unique: dict[str, Path] = {}
    for files in wheel_sets.values():
        for wheel in files:
            if wheel.name in unique and sha256(unique[wheel.name]) != sha256(wheel):
                sys.exit(f"{wheel.name} differs between two downloads; fetch again")
            unique.setdefault(wheel.name, wheel)
    manifest: dict = {
        "releases": {release: sorted(w.name for w in files) for release, files in wheel_sets.items()},
        "wheels": {},
    }
    folders: list[list] = []  # [used bytes, path]

    def room(size: int) -> Path:
        for slot in folders:
            if slot[0] + size <= part:
                slot[0] += size
                return slot[1]
        path = out / f"{len(folders):02d}"
        path.mkdir(parents=True)
        folders.append([size, path])
        return path

    for wheel in sorted(unique.values(), key=lambda p: -p.stat().st_size):
        size = wheel.stat().st_size
        entry = {"sha256": sha256(wheel), "size": size, "parts": []}
        with wheel.open("rb") as fh:
            index = 0
            while chunk := fh.read(part):
                name = wheel.name if size <= part else f"{wheel.name}.part{index:02d}"
                target = room(len(chunk)) / name
                target.write_bytes(chunk)
                entry["parts"].append(f"{target.parent.name}/{name}")
                index += 1
        manifest["wheels"][wheel.name] = entry
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", help="vLLM releases, each with a list bench/gpu/vllm-RELEASE.txt")
    parser.add_argument(
        "--run-only", action="store_true", help="only refresh DEST/run (the scripts and the patcher wheel)"
    )
    parser.add_argument(
        "--dest", type=Path, default=REPO / ".gpu", help="where wheels-*/, stage-*/ and run/ go (default: .gpu)"
    )
    parser.add_argument(
        "--speculators", metavar="VERSION", help="also put this speculators release in DEST/run (e.g. 0.4.0.1)"
    )
    args = parser.parse_args()
    pack_run(args.dest / "run", args.speculators)
    wheel = next((args.dest / "run").glob("patcher-*.whl")).name
    print(f"{args.dest / 'run'}: gpu_run.py, kv_probe.py, tiny_moe.py and {wheel}")
    if args.run_only:
        return
    if not args.releases:
        parser.error("name one or more releases (e.g. 0.20.0), or pass --run-only")
    wheel_sets = {}
    for release in args.releases:
        listing = pinned(release)
        wheels = args.dest / f"wheels-{release}"
        if wheels.exists():
            shutil.rmtree(wheels)  # exactly this list's wheels (pip's own cache makes it cheap)
        download(listing, wheels)
        wheel_sets[release] = sorted(wheels.glob("*.whl"))
    out = args.dest / ("stage-" + "+".join(args.releases))
    manifest = stage(wheel_sets, out)
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    total = sum(w["size"] for w in manifest["wheels"].values())
    print(f"{len(manifest['wheels'])} wheels, {total / 2**20:.0f} MiB, in {len(folders)} folders under {out}")
    for name in folders:
        size = sum(f.stat().st_size for f in (out / name).iterdir())
        print(f"  {out / name}  {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
