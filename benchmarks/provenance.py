"""Where a benchmark's numbers came from: the machine, the commit and the command, for its JSON.

Every benchmark that writes ``benchmarks/results/<name>.json`` puts ``"provenance":
provenance(argv)`` in it, ``argv`` being what its ``main`` was given (``None``: ``sys.argv``).
Nothing here raises: what cannot be found (no git, no ``/proc/cpuinfo``, no torch) is ``None``.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # benchmarks/
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _cpuinfo() -> tuple[str | None, list[str]]:
    """The CPU's model name and which of ``CPU_FLAGS`` it has (from ``/proc/cpuinfo``)."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or None, [f for f in CPU_FLAGS if f in flags]


def _torch() -> tuple[str | None, str | None]:
    """torch's version and the GPU's name (``None`` without one)."""
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        return torch.__version__, gpu
    except Exception:
        return None, None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine() -> dict[str, Any]:
    cpu, flags = _cpuinfo()
    torch_version, gpu = _torch()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_flags": flags,
        "gpu": gpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
    }


def command(argv: list[str] | None = None, script: str | None = None) -> str:
    """The command line as one would retype it from the repository's root."""
    if argv is None:
        argv = sys.argv[1:]
    path = Path(script or sys.argv[0]).resolve()
    try:
        shown = path.relative_to(HERE.parent).as_posix()
    except ValueError:
        shown = f"benchmarks/{path.name}" if path.parent == HERE else str(path)
    return shlex.join(["python", shown, *(str(a) for a in argv)])


def provenance(argv: list[str] | None = None, *, script: str | None = None) -> dict[str, Any]:
    """The machine, the commit (``dirty``: tracked files differ from it), the command, the date.

    ``script`` is the benchmark's file; by default the caller's (the module calling this).
    """
    if script is None:
        try:
            script = sys._getframe(1).f_code.co_filename
        except (AttributeError, ValueError):
            script = None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "machine": machine(),
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "command": command(argv, script),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
