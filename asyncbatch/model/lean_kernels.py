"""``lean_cpu.c`` and ``lean_gemv.c`` built once per machine into one library and bound with ``ctypes``: the
small operations of a CPU decode step, one call each instead of 4-11 torch ops, and its matrix products read
straight from the weights (``lean_step`` says where they go and why).

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
import struct
import subprocess
import tempfile
from pathlib import Path

from asyncbatch.model.cpu_features import hardware_cpu_flags
from asyncbatch.model.gguf_cache import cache_root

LEAN_STEP_ENV = "ASYNCBATCH_CPU_LEAN_STEP"
LEAN_PRODUCTS_ENV = "ASYNCBATCH_CPU_LEAN_PRODUCTS"
SOURCES = (Path(__file__).with_name("lean_cpu.c"), Path(__file__).with_name("lean_gemv.c"))
# -ffp-contract=off: no fused multiply-add where torch rounds the product and the sum apart. -fopenmp: the
# products split their weight rows over threads, and the attention's dot products may vectorise their float
# sums; the library links libgomp.so.1, the runtime torch has already loaded (torch's CPU wheels ship it), so
# both share one pool of threads. -fno-trapping-math: loops with a float-to-int conversion or a select (exp,
# the bfloat16 rounding) vectorise too; nothing here reads floating-point exception flags, and no value changes.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
# Tried in order where a build fails: a compiler without -march=native (some ARM ones) builds for the baseline
# ISA; one without OpenMP (clang without libomp) builds single-threaded products.
FLAG_SETS = (FLAGS, tuple(f for f in FLAGS if f != "-march=native"),
             tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in FLAGS if f != "-march=native"))
logger = logging.getLogger(__name__)

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "ab_rms_norm": (_P, _I, _I64, _I64, _P, _I, _F, _I, _P, _I),
    "ab_add_rms_norm": (_P, _I, _P, _I, _I64, _I64, _P, _I, _F, _I, _P, _I),
    "ab_qkv_rope_write": (_P, _I, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I, _I),
    "ab_decode_attention": (_P, _P, _P, _I, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I, _I, _I),
    "ab_silu_mul": (_P, _P, _I, _I64, _I64, _I64, _I, _P, _I),
    "ab_gemv": (_P, _I64, _I64, _P, _I, _P, _I, _I64, _P, _I),
}


def wanted() -> bool:
    """Whether CPU models take the lean step: unless ``ASYNCBATCH_CPU_LEAN_STEP=0``."""
    return os.environ.get(LEAN_STEP_ENV) != "0"


def products_wanted() -> bool:
    """Whether the lean step multiplies by ``lean_gemv.c`` where a weight is plain: unless
    ``ASYNCBATCH_CPU_LEAN_PRODUCTS=0``, which keeps each linear's own path (oneDNN, fbgemm, MKL) to compare."""
    return os.environ.get(LEAN_PRODUCTS_ENV) != "0"


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
    if not _norm_works(lib) or not _product_works(lib):
        logger.warning("lean CPU step: the built kernels compute wrong; the model keeps its torch ops")
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


def _product_works(lib: ctypes.CDLL) -> bool:
    """Two rows times a 70 x 40 weight with a bias against Python's sums, with float32 weights and with bfloat16
    ones: every value is a small integer, so any order of sums gives the same exact result. On one thread: a
    parallel region opened here would give the thread loading the model an OpenMP pool of its own beside the
    device thread's (``tests/test_kernel_threads.py``); the split over threads is the tests' to check."""
    rows, k, n = 2, 40, 70
    xs = [float((i % 7) - 3) for i in range(rows * k)]
    ws = [float((i % 5) - 2) for i in range(n * k)]
    bias = [float(i % 3) for i in range(n)]
    want = [sum(xs[r * k + i] * ws[j * k + i] for i in range(k)) + bias[j] for r in range(rows) for j in range(n)]
    x, b = (ctypes.c_float * len(xs))(*xs), (ctypes.c_float * n)(*bias)
    weights = (ctypes.c_float * len(ws))(*ws)
    as_bf16 = (ctypes.c_uint16 * len(ws))(*(struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in ws))
    for code, w in ((0, weights), (1, as_bf16)):
        out = (ctypes.c_float * (rows * n))()
        lib.ab_gemv(ctypes.addressof(x), rows, k, ctypes.addressof(w), code, ctypes.addressof(b), 0, n,
                    ctypes.addressof(out), 1)
        if list(out) != want:
            return False
    return True


def _built(compiler: str) -> Path:
    """The library's path in the cache, compiling it first where it is not there yet."""
    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True, timeout=30).stdout
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(b"\0".join([source, version.encode(), repr(FLAG_SETS).encode(),
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
        for i, flags in enumerate(FLAG_SETS):
            try:
                subprocess.run([compiler, *flags, "-o", temp, *map(str, SOURCES), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if i + 1 == len(FLAG_SETS):
                    raise
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target
