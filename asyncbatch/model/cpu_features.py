"""What the CPU can multiply natively, and so which dtype ``dtype="auto"`` picks there.

bfloat16 pays on a CPU only with native bfloat16 dot products: AVX512-BF16
(``avx512_bf16``, Cooper Lake, Zen 4 and later) or AMX (``amx_bf16``, Sapphire
Rapids and later) on x86, or the Arm BF16 extension (``bf16`` in the features
line). Without them torch converts every bfloat16 element to float32 inside
the matmul and runs far slower than float32 (AMD EPYC Zen 3, AVX2, a 576 x 1536
linear at 32 rows, one thread: 5.7 ms in bfloat16, 0.8 ms in float32). The
features come from ``/proc/cpuinfo`` (Linux); where it cannot be read, or on
any other CPU, ``auto`` stays float32.

``ASYNCBATCH_CPU_FLAGS`` (space- or comma-separated flag names), when set,
replaces the flags read from ``/proc/cpuinfo``: ``ASYNCBATCH_CPU_FLAGS=amx_bf16``
makes an AVX2 machine choose bfloat16 as a Sapphire Rapids would (its linears then
run on float32 kernels with every value a bfloat16 one, ``emulated_bf16``), and ``ASYNCBATCH_CPU_FLAGS=avx2`` makes an AMX machine choose
float32. It is how the test suite runs both sides of ``dtype="auto"`` on one
machine; engine core processes inherit it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

CPU_FLAGS_ENV = "ASYNCBATCH_CPU_FLAGS"
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
_CPUINFO = Path("/proc/cpuinfo")


def faked_cpu_flags() -> frozenset[str] | None:
    """The flags ``ASYNCBATCH_CPU_FLAGS`` names, or None where it is unset (an empty value fakes a CPU
    with no flags)."""
    value = os.environ.get(CPU_FLAGS_ENV)
    if value is None:
        return None
    return frozenset(value.replace(",", " ").split())


def hardware_cpu_flags() -> frozenset[str]:
    """The flags of the CPU itself, whatever ``ASYNCBATCH_CPU_FLAGS`` fakes (what kernels can run)."""
    try:
        return cpu_flags(_CPUINFO.read_text(errors="replace"))
    except OSError:
        return frozenset()


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The ``vendor_id`` of the first processor in ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``, ...);
    empty where the file or the line is missing (Arm lists none). Never faked: it says whose kernels run."""
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text(errors="replace")
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "vendor_id":
            return value.strip()
    return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm);
    empty where the file is missing. With ``cpuinfo`` omitted, ``ASYNCBATCH_CPU_FLAGS`` wins where set."""
    if cpuinfo is None:
        faked = faked_cpu_flags()
        if faked is not None:
            return faked
        try:
            cpuinfo = _CPUINFO.read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True, slots=True)
class CpuDtypeChoice:
    dtype: torch.dtype
    reason: str


def choose_cpu_dtype(flags: frozenset[str] | None = None, capability: str | None = None) -> CpuDtypeChoice:
    """bfloat16 where the CPU has native bfloat16 dot products, else float32, with the reason."""
    faked = ""
    if flags is None:
        flags = faked_cpu_flags()
        if flags is None:
            flags = cpu_flags()
        else:
            faked = f"; flags faked by {CPU_FLAGS_ENV}"
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    native = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
    if native:
        return CpuDtypeChoice(torch.bfloat16, f"bfloat16: the CPU has native bfloat16 dot products "
                                              f"({', '.join(native)}; torch capability {capability}{faked})")
    return CpuDtypeChoice(torch.float32, f"float32: no native bfloat16 dot products on this CPU (torch "
                                         f"capability {capability}, no {'/'.join(NATIVE_BF16_FLAGS)} flag"
                                         f"{faked})")
