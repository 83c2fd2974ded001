"""Compile the package's C++ CPU kernels with the machine's compiler, once, and cache the result.

The library is built for this CPU (``-march=native``; ``$RADIXLANG_NATIVE_MARCH`` names another
target, such as ``x86-64-v3`` for AVX2 or ``skylake-avx512`` for AVX-512 without bfloat16, so that
one machine runs the code paths of an older CPU class) and kept under
``$RADIXLANG_CACHE/native`` (default ``~/.cache/radixlang/native``), named by a hash of the
source, the flags, the compiler's version and the CPU's model and flags, so that a changed
source, compiler or machine builds afresh. Builds take a few seconds (no torch headers: the
kernels take raw pointers through ctypes). A build writes to a temporary name and renames, under
a file lock, so concurrent processes never load a half-written library.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "native"
FLAGS = (
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-fPIC",
    # Vectorised exp and reductions; infinities and NaNs keep their meaning. Compile-only: a
    # link with -ffast-math would add crtfastmath.o, whose constructor flushes subnormals to
    # zero in the whole process (torch and every library included) as soon as it loads.
    "-ffast-math",
    "-fno-finite-math-only",
)
LINK_FLAGS = ("-shared", "-fopenmp")
# Per source, after FLAGS: sums that must keep the order written.
_ORDERED = ("-fno-associative-math", "-fno-reciprocal-math")
# The block kernels: their quantizers and dequantizers match numpy references bit for bit (no
# fused multiply-adds where the reference rounds twice).
SOURCE_FLAGS = {
    "invariant_linear": _ORDERED,
    "block32_linear": (*_ORDERED, "-ffp-contract=off"),
    "kquant_linear": (*_ORDERED, "-ffp-contract=off"),
    "packed_linear": (*_ORDERED, "-ffp-contract=off"),
}


def target_flag() -> str:
    """``-march=native``, or the target ``$RADIXLANG_NATIVE_MARCH`` names (it must run here)."""
    march = os.environ.get("RADIXLANG_NATIVE_MARCH", "").strip() or "native"
    return f"-march={march}"


def compile_flags(name: str) -> tuple[str, ...]:
    return (*FLAGS, target_flag(), *SOURCE_FLAGS.get(name, ()))


class NativeBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded here."""


def cache_root() -> Path:
    env = os.environ.get("RADIXLANG_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "radixlang"
    return root / "native"


def find_compiler() -> str:
    """``$CXX``, else the first of g++, c++, clang++ on the PATH."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise NativeBuildError(f"no C++ compiler found (tried {', '.join(candidates)}; set CXX)")


def _machine_fingerprint() -> str:
    """The CPU's model and feature flags: ``-march=native`` code runs only where they match."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in wanted]
    return "\n".join(sorted(set(lines)))


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"{compiler} --version failed: {exc}") from exc
    return done.stdout


def library_path(name: str, compiler: str) -> Path:
    source = (SOURCE_DIR / f"{name}.cpp").read_bytes()
    # The shared headers too: a changed header builds every library afresh.
    headers = b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256()
    flags = " ".join((*compile_flags(name), *LINK_FLAGS)).encode()
    for part in (source, headers, flags, _compiler_version(compiler).encode()):
        key.update(part)
    key.update(_machine_fingerprint().encode())
    return cache_root() / f"{name}-{key.hexdigest()[:16]}.so"


def build(name: str) -> Path:
    """The compiled library of ``native/<name>.cpp``, building it when not cached."""
    compiler = find_compiler()
    target = library_path(name, compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while this one waited
            return target
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        obj = tmp + ".o"
        steps = [
            [compiler, *compile_flags(name), "-c", str(SOURCE_DIR / f"{name}.cpp"), "-o", obj],
            [compiler, *LINK_FLAGS, obj, "-o", tmp],
        ]
        try:
            for command in steps:
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                except (OSError, subprocess.SubprocessError) as exc:
                    raise NativeBuildError(
                        f"building {name}.cpp failed ({' '.join(command)}): {exc}"
                    ) from exc
                if done.returncode != 0:
                    output = (done.stderr + done.stdout).strip()
                    raise NativeBuildError(
                        f"building {name}.cpp failed ({' '.join(command)}):\n{output[-4000:]}"
                    )
            # Only a finished build gets the cached name: a failed one leaves nothing to reuse.
            os.replace(tmp, target)
        finally:
            for path in (tmp, obj):
                if os.path.exists(path):
                    os.unlink(path)
    return target


def load(name: str) -> ctypes.CDLL:
    """Build (if needed) and load ``native/<name>.cpp``.

    Load it after torch: its OpenMP dependency then resolves to the runtime torch loaded, and the
    two share one thread pool.
    """
    import torch  # noqa: F401  (the OpenMP runtime comes with it)

    path = build(name)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"loading {path} failed: {exc}") from exc


def disabled() -> bool:
    """``RADIXLANG_NATIVE=0``: the native kernels are not tried."""
    return os.environ.get("RADIXLANG_NATIVE", "1") == "0"


def usable(load_library: Callable[[], object], what: str) -> bool:
    """Whether ``load_library()`` builds and loads here; ``RADIXLANG_NATIVE=0`` says no without
    trying. A failure warns, with the compiler's message, and the caller takes its torch path
    (the callers cache the answer, so the warning comes once per library and process)."""
    if disabled():
        return False
    try:
        load_library()
    except (NativeBuildError, OSError) as exc:
        warnings.warn(f"{what} unavailable, using torch: {exc}", stacklevel=3)
        return False
    return True


def skip_reason(load_library: Callable[[], object]) -> str | None:
    """For tests: why the tests of ``load_library()``'s kernels skip here, or ``None`` once it
    is built and loaded.

    Only two things are reasons to skip: ``RADIXLANG_NATIVE=0``, and no C++ compiler on the
    PATH (:func:`find_compiler`). Where a compiler is found, a build that fails is a failure:
    the :class:`NativeBuildError` raised, which carries the compiler's output, propagates.
    """
    if disabled():
        return "RADIXLANG_NATIVE=0"
    try:
        find_compiler()
    except NativeBuildError as exc:
        return str(exc)
    load_library()
    return None
