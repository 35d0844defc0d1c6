"""``lean_cpu.c`` built once per machine and bound with ``ctypes``: the small operations of a CPU decode step,
one call each instead of 4-11 torch ops (``lean_step`` says where they go and why).

The library is compiled by the system's C compiler (``$CC``, else ``cc``) at first use, in about a second, into
``<cache>/kernels/<digest>/`` (``gguf_cache.cache_root``: ``$ASYNCBATCH_CACHE`` or ``~/.cache/asyncbatch``). The
digest covers the source, the compiler's version, the flags and this CPU's feature flags, so a cache shared
between machines never hands one a library built for another's instructions. Parallel processes may build it
at once: each writes its own temporary file and renames it into place. Without a compiler, or if the build or
the check of one norm against Python's arithmetic fails, ``library()`` returns None (logged once) and the model
keeps its torch ops.

``ctypes`` releases the GIL for the length of each call, as torch's ops do, so the planner thread runs beside it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from asyncbatch.model.cpu_features import hardware_cpu_flags
from asyncbatch.model.gguf_cache import cache_root

LEAN_STEP_ENV = "ASYNCBATCH_CPU_LEAN_STEP"
SOURCE = Path(__file__).with_name("lean_cpu.c")
# -ffp-contract=off: no fused multiply-add where torch rounds the product and the sum apart. -fopenmp-simd:
# the attention's dot products may vectorise their float sums (no OpenMP runtime is linked). -fno-trapping-math:
# loops with a float-to-int conversion or a select (exp, the bfloat16 rounding) vectorise too; nothing here reads
# floating-point exception flags, and no value changes.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp-simd", "-fPIC", "-shared")
logger = logging.getLogger(__name__)

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "ab_rms_norm": (_P, _I, _I64, _I64, _P, _I, _F, _I, _P, _I),
    "ab_add_rms_norm": (_P, _I, _P, _I, _I64, _I64, _P, _I, _F, _I, _P, _I),
    "ab_qkv_rope_write": (_P, _I, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I, _I),
    "ab_decode_attention": (_P, _P, _P, _I, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I, _I),
    "ab_silu_mul": (_P, _P, _I, _I64, _I64, _I64, _I, _P, _I),
}


def wanted() -> bool:
    """Whether CPU models take the lean step: unless ``ASYNCBATCH_CPU_LEAN_STEP=0``."""
    return os.environ.get(LEAN_STEP_ENV) != "0"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built and bound library, or None where it cannot be had (the reason is logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("lean CPU step: no C compiler (cc, gcc or $CC); the model keeps its torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_built(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or ""
        logger.info("lean CPU step: the kernels could not be built (%s %s); the model keeps its torch ops", exc,
                    detail.strip()[-500:] if isinstance(detail, str) else "")
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    if not _norm_works(lib):
        logger.warning("lean CPU step: the built kernels give a wrong RMSNorm; the model keeps its torch ops")
        return None
    return lib


def _norm_works(lib: ctypes.CDLL) -> bool:
    """One float32 RMSNorm through the library against the same arithmetic in Python: a library that loads but
    computes wrong (another ABI, a miscompile) is never used."""
    values = [0.5 * i - 3.0 for i in range(40)]
    x, w, out = (ctypes.c_float * 40)(*values), (ctypes.c_float * 40)(*[1.0] * 40), (ctypes.c_float * 40)()
    lib.ab_rms_norm(ctypes.addressof(x), 0, 1, 40, ctypes.addressof(w), 0, 1e-5, 0, ctypes.addressof(out), 0)
    inv = (sum(v * v for v in values) / 40 + 1e-5) ** -0.5
    return all(abs(o - v * inv) <= 1e-5 for o, v in zip(out, values))


def _built(compiler: str) -> Path:
    """The library's path in the cache, compiling it first where it is not there yet."""
    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(),
                                        platform.machine().encode(),
                                        " ".join(sorted(hardware_cpu_flags())).encode()])).hexdigest()[:16]
    folder = cache_root() / "kernels" / digest
    target = folder / "lean_cpu.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        try:
            subprocess.run([compiler, *FLAGS, "-o", temp, str(SOURCE), "-lm"], check=True, capture_output=True,
                           text=True, timeout=120)
        except subprocess.CalledProcessError:  # a compiler without -march=native (some ARM ones): the baseline ISA
            subprocess.run([compiler, *(f for f in FLAGS if f != "-march=native"), "-o", temp, str(SOURCE), "-lm"],
                           check=True, capture_output=True, text=True, timeout=120)
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target
