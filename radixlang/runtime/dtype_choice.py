"""The weights' dtype when none is named: ``"auto"``, the one default of the engine, the local
runtime, ``radixlang serve`` and ``radixlang generate``.

bfloat16 halves the memory of weights and KV cache, but it is only faster where the hardware
does bfloat16 arithmetic itself. On a CPU without it torch emulates bfloat16 matmuls: on a
development machine without AVX-512 BF16 or AMX a 32x576 by 576x49152 matmul took 117 ms in
bfloat16 against 48 ms in float32 (2.4x slower). So "auto" picks bfloat16 on a CUDA device that
supports it and on a CPU whose flags say it computes bfloat16 natively, and float32 otherwise.

``RADIXLANG_AUTO_DTYPE`` (``float32``, ``bfloat16`` or ``float16``) makes "auto" that dtype
whatever the hardware: how a test run on a machine without native bfloat16 exercises what
"auto" picks on one that has it (and the other way round).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

AUTO = "auto"
# Linux /proc/cpuinfo flags of CPUs that compute bfloat16 natively: AVX-512 BF16 (Cooper Lake,
# Zen 4 and later) and AMX (Sapphire Rapids and later).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO = Path("/proc/cpuinfo")
AUTO_DTYPE_ENV = "RADIXLANG_AUTO_DTYPE"
FORCEABLE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags named on ``/proc/cpuinfo``'s ``flags`` lines (x86 Linux)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return flags


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively (from ``cpuinfo``'s text, by default the
    machine's ``/proc/cpuinfo``; False where there is none, as on macOS and Windows)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return False
    return bool(cpu_flags(cpuinfo) & NATIVE_BF16_CPU_FLAGS)


def auto_dtype(device: str | torch.device, cpuinfo: str | None = None) -> torch.dtype:
    """bfloat16 where ``device`` computes it natively (a CUDA device that supports it, a CPU
    with AVX-512 BF16 or AMX), else float32. ``cpuinfo`` stands in for ``/proc/cpuinfo``."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            supported = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if supported else torch.float32
    if device.type == "cpu" and cpu_has_native_bf16(cpuinfo):
        return torch.bfloat16
    return torch.float32


def choose_dtype(dtype: str | torch.dtype, device: str | torch.device) -> str | torch.dtype:
    """``dtype`` itself, or for ``"auto"`` the dtype :func:`auto_dtype` picks for ``device``
    (or ``$RADIXLANG_AUTO_DTYPE`` where it is set)."""
    if dtype != AUTO:
        return dtype
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in FORCEABLE:
            raise ValueError(
                f"{AUTO_DTYPE_ENV} must be one of {', '.join(FORCEABLE)}; got {forced!r}"
            )
        return FORCEABLE[forced]
    return auto_dtype(device)
