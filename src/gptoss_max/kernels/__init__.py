"""gpt-oss Mojo kernels for MAX graphs.

`kernels_path()` is what a `Graph` needs in `custom_extensions`; the graph
wrappers in `ops.py` add it to the current graph themselves.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from gptoss_max.settings import cache_dir

SOURCE_DIR = Path(__file__).resolve().parent
PACKAGE_NAME = "gptoss_kernels"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for name in ("mojo", "max"):
        try:
            h.update(f"{name}=={version(name)}\n".encode())
        except PackageNotFoundError:
            pass
    for src in sorted(SOURCE_DIR.glob("*.mojo")):
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _precompile(out: Path) -> None:
    from mojo.paths import MojoCompilationError
    from mojo.run import subprocess_run_mojo

    out.parent.mkdir(parents=True, exist_ok=True)
    # The module name is baked from the file stem, so the staging copy keeps
    # the final name; publish by an atomic rename (other processes may read).
    staging = out.parent / f".staging.{os.getpid()}" / out.name
    staging.parent.mkdir(exist_ok=True)
    args = ["precompile", str(SOURCE_DIR), "-o", str(staging)]
    try:
        subprocess_run_mojo(args, capture_output=True, check=True)
        os.replace(staging, out)
    except subprocess.CalledProcessError as e:
        raise MojoCompilationError.from_subprocess_error(SOURCE_DIR, args, e) from e
    finally:
        staging.unlink(missing_ok=True)
        try:
            staging.parent.rmdir()
        except OSError:
            pass


@lru_cache(maxsize=1)
def kernels_path() -> Path:
    """The precompiled kernel package (`.mojoc`), built once per source hash
    under `settings.cache_dir()/kernels/`."""
    out = cache_dir() / "kernels" / _sources_digest() / f"{PACKAGE_NAME}.mojoc"
    if not out.exists():
        _precompile(out)
    return out
