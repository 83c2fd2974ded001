"""``dtype="auto"``: bfloat16 where the device computes it natively, float32 elsewhere."""

from __future__ import annotations

import contextlib

import pytest
import torch

from radixlang.runtime import dtype_choice
from radixlang.runtime.dtype_choice import auto_dtype, choose_dtype, cpu_flags, cpu_has_native_bf16

# Shortened /proc/cpuinfo texts: two cores of each machine.
WITHOUT_BF16 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni
bugs\t\t: spectre_v1 spectre_v2

processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni
"""
WITH_AVX512_BF16 = WITHOUT_BF16.replace("avx512_vnni", "avx512_vnni avx512_bf16")
WITH_AMX = WITHOUT_BF16.replace("avx512_vnni", "avx512_vnni amx_bf16 amx_tile amx_int8")
# bf16 named where it is not a feature flag (a model name, the bugs line) does not count.
BF16_ELSEWHERE = WITHOUT_BF16.replace("@ 2.20GHz", "avx512_bf16").replace("spectre_v2", "amx_bf16")


def test_cpu_flags_are_read_from_the_flags_lines():
    flags = cpu_flags(WITH_AMX)
    assert {"avx2", "avx512f", "amx_bf16", "amx_tile"} <= flags
    assert "spectre_v1" not in flags and "GenuineIntel" not in flags
    assert cpu_flags("") == set()


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (WITHOUT_BF16, False),
        (WITH_AVX512_BF16, True),
        (WITH_AMX, True),
        (BF16_ELSEWHERE, False),
        ("", False),
    ],
)
def test_auto_on_a_cpu_is_bfloat16_only_with_native_bf16(cpuinfo, native):
    assert cpu_has_native_bf16(cpuinfo) is native
    assert auto_dtype("cpu", cpuinfo) == (torch.bfloat16 if native else torch.float32)


def test_auto_reads_the_machines_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.delenv(dtype_choice.AUTO_DTYPE_ENV, raising=False)
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(dtype_choice, "CPUINFO", path)
    assert auto_dtype("cpu") == torch.float32  # no such file (macOS, Windows)
    path.write_text(WITH_AMX)
    assert auto_dtype("cpu") == torch.bfloat16
    assert choose_dtype("auto", "cpu") == torch.bfloat16
    path.write_text(WITHOUT_BF16)
    assert choose_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_cuda_follows_the_devices_bf16_support(monkeypatch, supported):
    asked: list[bool] = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return supported

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    assert auto_dtype("cuda:0", WITHOUT_BF16) == (torch.bfloat16 if supported else torch.float32)
    assert asked == [False]  # emulated bfloat16 is the slow case "auto" avoids


def test_other_devices_and_named_dtypes():
    assert auto_dtype("meta", WITH_AMX) == torch.float32
    assert choose_dtype("bfloat16", "cpu") == "bfloat16"
    assert choose_dtype(torch.float16, "cpu") == torch.float16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_a_real_cuda_device():
    native = torch.cuda.get_device_capability() >= (8, 0)
    assert auto_dtype("cuda") == (torch.bfloat16 if native else torch.float32)


def test_the_environment_can_force_what_auto_picks(tmp_path, monkeypatch):
    """RADIXLANG_AUTO_DTYPE: a machine without native bfloat16 runs what "auto" picks on one
    with it (how CI exercises the bfloat16 path); explicit dtypes are left alone."""
    path = tmp_path / "cpuinfo"
    path.write_text(WITHOUT_BF16)
    monkeypatch.setattr(dtype_choice, "CPUINFO", path)
    monkeypatch.setenv(dtype_choice.AUTO_DTYPE_ENV, "bfloat16")
    assert choose_dtype("auto", "cpu") == torch.bfloat16
    assert choose_dtype("float32", "cpu") == "float32"
    monkeypatch.setenv(dtype_choice.AUTO_DTYPE_ENV, "float32")
    path.write_text(WITH_AMX)
    assert choose_dtype("auto", "cpu") == torch.float32
    monkeypatch.setenv(dtype_choice.AUTO_DTYPE_ENV, "int4")
    with pytest.raises(ValueError, match="RADIXLANG_AUTO_DTYPE must be one of"):
        choose_dtype("auto", "cpu")
