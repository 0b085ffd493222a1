"""Loader for the native CPU kernel library (``_aipc_native``, plain C built by setup.py).

The library is called through ctypes (it has no Python or torch headers); ctypes releases the GIL
during the call. Its C API and codes are declared once, in ``csrc/aipc_native.h``: at load the ABI
version and the names of the ISA and dtype codes are read back from the library and checked against
:data:`ISAS` and :data:`DTYPE_CODES` (a stale or foreign build fails loudly), and status codes are
worded by the library itself (:func:`status_message`).

The linear kernel is called through ``aipc_lowbit_linear_v``, its arguments packed in one int64
vector: ctypes converts one pointer instead of 18 arguments (0.2 us instead of 2 us a call).
Threads: every call passes ``torch.get_num_threads()``, so the kernels follow the size PyTorch (and
vLLM's CPU worker, which sets it) chose, instead of OpenMP's own default.
"""
from __future__ import annotations

import ctypes
import glob
import math
import os
import struct
from array import array
from functools import lru_cache
from typing import Optional, Sequence

import torch

ABI_VERSION = 10  # AIPC_ABI_VERSION of the library this module binds
ISAS = {"scalar": 0, "avx2": 1, "avx_vnni": 2, "avx512_vnni": 3, "amx_int8": 4}
ISA_NAMES = {v: k for k, v in ISAS.items()}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: scale_dt codes of aipc_lowbit_linear: the dtypes, and int8 for the two-level form (AIPC_SCALE_I8)
SCALE_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 3}
#: scale_dt of the progressive form (AIPC_SCALE_I8_PROG: int8 scales and mins, one set of supers)
SCALE_PROG = 4
#: aipc_dequant: how the W4A16 kernel turns a 4-bit code into a float
DEQUANT_CODES = {"e0m4": 0, "int": 1}


def _check_codes(lib: ctypes.CDLL, path: str) -> None:
    """Refuses a library whose ABI version or ISA / dtype codes differ from this module's tables (and
    declares the name queries' signatures)."""
    version = lib.aipc_abi_version() if hasattr(lib, "aipc_abi_version") else None
    if version != ABI_VERSION:
        raise RuntimeError(
            f"{path}: native library ABI version {version}, aipc_kernels.core.native expects {ABI_VERSION}; rebuild it "
            "(setup.py build_ext --inplace, or reinstall aipc-plugins)"
        )
    for fn in ("aipc_status_message", "aipc_isa_name", "aipc_dtype_name"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_int]
    dtypes = {str(t).removeprefix("torch."): code for t, code in DTYPE_CODES.items()}
    for what, name_of, table in (("ISA", lib.aipc_isa_name, ISAS), ("dtype", lib.aipc_dtype_name, dtypes)):
        codes = {}
        while (name := name_of(len(codes))) is not None:
            codes[name.decode()] = len(codes)
        if codes != table:
            raise RuntimeError(f"{path}: the library's {what} codes {codes} differ from aipc_kernels.core.native's {table}")


#: the folder of the built libraries (_aipc_native, _aipc_ops): the aipc_kernels package itself
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

@lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The loaded native library, or None when it was not built (``AIPC_NO_NATIVE=1``).
    ``AIPC_NATIVE_LIB=/path/to/lib.so`` loads another build of it (experiments, benchmarks)."""
    here = PACKAGE_DIR
    override = os.environ.get("AIPC_NATIVE_LIB")
    found = [override] if override else sorted(glob.glob(os.path.join(here, "_aipc_native*.so")))
    if not found:
        return None
    lib = ctypes.CDLL(found[0])
    _check_codes(lib, found[0])
    for fn in ("aipc_lowbit_linear_v", "aipc_lowbit_linear_a16_v", "aipc_dense_linear_v", "aipc_dense_linear_fused_v"):
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.aipc_bf16_dot_products.restype = ctypes.c_int
    lib.aipc_lowbit_a16_fastest_dequant.restype = ctypes.c_int
    for fn in ("aipc_best_isa", "aipc_get_isa"):
        getattr(lib, fn).restype = ctypes.c_int
    lib.aipc_set_isa.argtypes = [ctypes.c_int]
    isa = os.environ.get("AIPC_ISA")
    if isa:
        set_isa(isa, lib)
    return lib


def available() -> bool:
    """Whether the native kernels were built and load."""
    return library() is not None


@lru_cache(maxsize=1)
def ops_library() -> Optional[ctypes.CDLL]:
    """The C++ library of the native ops' CPU kernels (``csrc/ops/``: ``aipc::lowbit_linear_cpu``,
    ``aipc::lowbit_linear_a16_cpu``, ``aipc::rope`` and ``aipc::prologue``, registered with the dispatcher when it
    loads), bound to the kernel library's entry points; None when either was not built (see setup.py). Loading it
    is what registers the CPU kernels, so the modules defining their schemas call this after defining them."""
    lib = library()
    found = sorted(glob.glob(os.path.join(PACKAGE_DIR, "_aipc_ops*.so")))
    if lib is None or not found:
        return None
    ops = ctypes.CDLL(found[0])
    entry = lambda fn: ctypes.cast(getattr(lib, fn), ctypes.c_void_p)  # noqa: E731
    binds = {"aipc_ops_bind": ("aipc_lowbit_linear", "aipc_lowbit_linear_a16", "aipc_status_message"),
             "aipc_rope_op_bind": ("aipc_rope",), "aipc_prologue_op_bind": ("aipc_dense_prologue",)}  # fmt: skip
    versions = set()
    for bind, entries in binds.items():
        fn = getattr(ops, bind, None)
        if fn is None:
            raise RuntimeError(f"{found[0]} has no {bind} (an older build); rebuild it (setup.py build_ext --inplace, "
                               f"or reinstall aipc-plugins)")  # fmt: skip
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p] * len(entries)
        versions.add(fn(*(entry(e) for e in entries)))
    if versions != {ABI_VERSION}:
        raise RuntimeError(f"{found[0]}: built against native ABI version {sorted(versions)}, the kernel library has "
                           f"{ABI_VERSION}; rebuild both (setup.py build_ext --inplace, or reinstall aipc-plugins)")
    return ops


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("aipc_kernels native library is not built; reinstall aipc-plugins without AIPC_NO_NATIVE=1")
    return lib


def status_message(status: int) -> str:
    """What a status code of the library's entry points means (worded by the library)."""
    return _lib().aipc_status_message(status).decode()


def best_isa() -> str:
    """Best instruction set the CPU offers the kernels."""
    return ISA_NAMES[_lib().aipc_best_isa()]


def get_isa() -> str:
    """Instruction set the kernels use now."""
    return ISA_NAMES[_lib().aipc_get_isa()]


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs the kernels with (those :func:`set_isa` accepts), in
    :data:`ISAS` order: not every ISA ranked below the best one (an AVX-512 CPU may lack AVX-VNNI).
    Each is tried with the library's own check; the ISA in use is left as it was."""
    lib = _lib()
    current = lib.aipc_get_isa()
    try:
        return [name for name, code in ISAS.items() if lib.aipc_set_isa(code) == 0]
    finally:
        lib.aipc_set_isa(current)


def set_isa(name: str, lib: Optional[ctypes.CDLL] = None) -> None:
    """Forces an instruction set (``AIPC_ISA`` does the same at load); errors if the CPU lacks it."""
    if name not in ISAS:
        raise ValueError(f"AIPC_ISA / isa={name!r} is unknown; use one of {list(ISAS)}")
    if (lib or _lib()).aipc_set_isa(ISAS[name]) != 0:
        raise ValueError(f"isa={name!r} is not supported by this CPU (best: {best_isa()})")


def _require_dense(t: Optional[torch.Tensor]) -> None:
    """Refuses a strided view the C code would misread as dense."""
    if t is not None and not t.is_contiguous():
        raise ValueError(f"native kernel operand of shape {tuple(t.shape)} must be contiguous (call .contiguous())")


@lru_cache(maxsize=64)
def _f32_bits(v: float) -> int:
    """The float32 bit pattern of ``v`` as a signed int (how ``aipc_lowbit_linear_v`` takes floats)."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def lowbit_linear_args(
    y: torch.Tensor,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    bits: int,
    group_size: int,
    cmul: float,
    zero: float,
    act_group: int,
    act_amax: Optional[torch.Tensor] = None,
    supers: Optional[torch.Tensor] = None,
) -> array:
    """The argument vector of the C entry point ``aipc_lowbit_linear_v`` for dense operands (x and y with
    their leading dimensions flattened to M rows); pass ``vector.buffer_info()[0]``. ``zero``: the code
    book's fixed zero point, or NaN when it stores one per group (the C entry then requires ``zeros``);
    ``zeros`` with a finite ``zero``: the min form, ``zeros`` holding the per-group mins.
    ``act_amax``: None, or dense float32 [M] per-token activation absmax values the kernel quantizes x
    with instead of each token's own (``act_group == K``). The caller keeps the tensors alive while the
    kernel runs. ``supers``: the two-level form's super-block scales (``scales`` int8), dense float32
    ``[S, N/16, K/SB, 16]``."""
    K = x.shape[-1]
    return array("q", (
        x.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // K if K else 0, K, qweight.data_ptr(), bits, y.shape[-1],
        scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), scale_dtype_code(scales, zeros, zero, supers), group_size,
        _f32_bits(cmul), _f32_bits(zero), 0 if bias is None else bias.data_ptr(), y.data_ptr(), act_group,
        torch.get_num_threads(), 0 if act_amax is None else act_amax.data_ptr(),
        0 if supers is None else supers.data_ptr(), 0 if supers is None else K // supers.shape[-2],
    ))  # fmt: skip


def scale_dtype_code(scales: torch.Tensor, zeros: Optional[torch.Tensor], zero: float,
                     supers: Optional[torch.Tensor]) -> int:
    """``scale_dt`` of ``aipc_lowbit_linear``: the scales' dtype, or the two-level form's code; a min form
    (``zeros`` the mins, ``zero`` finite) with one set of supers is the progressive form (AIPC_SCALE_I8_PROG)."""
    if supers is not None and zeros is not None and not math.isnan(zero) and supers.shape[0] == 1:
        return SCALE_PROG
    return SCALE_DTYPE_CODES[scales.dtype]


def lowbit_linear_into(
    y: torch.Tensor,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    bits: int,
    group_size: int,
    cmul: float,
    zero: float,
    act_group: int,
    act_amax: Optional[torch.Tensor] = None,
    check_dense: bool = True,
    supers: Optional[torch.Tensor] = None,
) -> None:
    """Runs the native kernel: ``y[..., N] = x[..., K] @ W^T + bias`` with W in the ``cpu_vnni16`` layout
    (x and y dense, their leading dimensions flattened to M rows; ``act_amax``: see
    :func:`lowbit_linear_args`). ``check_dense=False`` skips the contiguity checks, for a caller (the
    op) that has made every operand dense itself."""
    if check_dense:
        for t in (y, x, qweight, scales, zeros, bias, act_amax, supers):
            _require_dense(t)
        if act_amax is not None and (act_amax.dtype != torch.float32 or act_amax.numel() != x.numel() // x.shape[-1]):
            raise ValueError(
                f"act_amax of shape {tuple(act_amax.shape)} and dtype {act_amax.dtype}: expected float32 with one "
                f"value per token of x (M={x.numel() // x.shape[-1]})"
            )
    args = lowbit_linear_args(y, x, qweight, scales, zeros, bias, bits, group_size, cmul, zero, act_group, act_amax,
                              supers)  # fmt: skip
    status = _lib().aipc_lowbit_linear_v(args.buffer_info()[0])
    if status != 0:
        raise RuntimeError(
            f"aipc_lowbit_linear failed: {status_message(status)} (M={args[2]}, K={args[3]}, N={args[6]}, "
            f"group_size={group_size}, act_group={act_group}, act_amax={'None' if act_amax is None else 'given'})"
        )


def lowbit_linear_a16_args(
    y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], group_size: int, zero: float, dequant: str,
) -> array:
    """The argument vector of ``aipc_lowbit_linear_a16_v`` for dense operands (see
    :func:`lowbit_linear_a16_into`); the caller keeps the tensors alive while the kernel runs."""
    K = x.shape[-1]
    return array("q", (
        x.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // K if K else 0, K, qweight.data_ptr(), 4, y.shape[-1],
        scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), DTYPE_CODES[scales.dtype], group_size,
        _f32_bits(zero), 0 if bias is None else bias.data_ptr(), y.data_ptr(), DEQUANT_CODES[dequant],
        torch.get_num_threads(),
    ))  # fmt: skip


def lowbit_linear_a16_into(
    y: torch.Tensor,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    group_size: int,
    zero: float,
    dequant: str,
    check_dense: bool = True,
) -> None:
    """Runs the activation-exact W4A16 kernel: ``y[..., N] = x[..., K] @ W^T + bias`` for 4-bit codes in the
    ``cpu_vnni16`` layout, x never quantized. ``zero``: the code book's fixed zero point, or NaN when
    ``zeros`` holds one per group; ``dequant``: ``e0m4`` (bit operations) or ``int`` (conversion), see
    ``csrc/generic/lowbit_a16.c``."""
    if dequant not in DEQUANT_CODES:
        raise ValueError(f"dequant={dequant!r} is unknown; use one of {list(DEQUANT_CODES)}")
    if check_dense:
        for t in (y, x, qweight, scales, zeros, bias):
            _require_dense(t)
    args = lowbit_linear_a16_args(y, x, qweight, scales, zeros, bias, group_size, zero, dequant)
    status = _lib().aipc_lowbit_linear_a16_v(args.buffer_info()[0])
    if status != 0:
        raise RuntimeError(
            f"aipc_lowbit_linear_a16 failed: {status_message(status)} (M={args[2]}, K={args[3]}, N={args[6]}, "
            f"group_size={group_size}, dequant={dequant})"
        )


def fastest_a16_dequant() -> str:
    """The dequantization (``e0m4`` / ``int``, :data:`DEQUANT_CODES`) the W4A16 kernel of the ISA in use runs
    fastest: ``int`` on the AVX2 kernel (AVX2 and AVX-VNNI CPUs), ``e0m4`` elsewhere. Both are exact."""
    code = _lib().aipc_lowbit_a16_fastest_dequant()
    return next(name for name, c in DEQUANT_CODES.items() if c == code)


def bf16_dot_products() -> bool:
    """Whether the kernels multiply bf16 by bf16 with AVX512-BF16 dot products under the ISA in use (the
    dense kernel with bf16 activations and weights, the W4A16 kernel with bf16 activations)."""
    return bool(_lib().aipc_bf16_dot_products())


def dense_linear_args(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> array:
    """The argument vector of ``aipc_dense_linear_v`` for dense operands (see :func:`dense_linear_into`); the
    caller keeps the tensors alive while the kernel runs."""
    K = x.shape[-1]
    return array("q", (
        x.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // K if K else 0, K, weight.data_ptr(),
        DTYPE_CODES[weight.dtype], y.shape[-1], 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    ))  # fmt: skip


def dense_linear_into(
    y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], check_dense: bool = True
) -> None:
    """Runs the small-M dense kernel: ``y[..., N] = x[..., K] @ weight[N, K]^T + bias`` (x, bias and y in
    one dtype, the weight in float32 / bf16 / fp16; x and y dense, their leading dimensions flattened to M
    rows), every weight row streamed once for all rows of x; see ``csrc/generic/dense_linear.c``.
    ``check_dense=False`` skips the contiguity checks, for a caller (the op) that has made every operand
    dense itself."""
    if check_dense:
        for t in (y, x, weight, bias):
            _require_dense(t)
    args = dense_linear_args(y, x, weight, bias)
    status = _lib().aipc_dense_linear_v(args.buffer_info()[0])
    if status != 0:
        raise RuntimeError(
            f"aipc_dense_linear failed: {status_message(status)} (M={args[2]}, K={args[3]}, N={args[6]}, "
            f"x {x.dtype}, weight {weight.dtype})"
        )


#: prologue codes of ``aipc_dense_linear_fused`` (``aipc_prologue`` in csrc/aipc_native.h)
PROLOGUES = {"none": 0, "rmsnorm": 1, "silu_mul": 2}
#: weights one ``aipc_dense_linear_fused`` call reads (AIPC_DENSE_MAX_SEGMENTS)
MAX_SEGMENTS = 4


def dense_linear_fused_into(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[Optional[torch.Tensor]],
    prologue: str = "none",
    gamma: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
) -> None:
    """Runs ``aipc_dense_linear_fused`` (see csrc/aipc_native.h): ``y = prologue(x) @ cat(weights)^T + cat(biases)
    (+ residual)``, each weight read once in its own tensor. Every operand must be dense (the caller, the op
    in :mod:`aipc_kernels.decoder.fused_linear`, makes them so); x's last dimension is K, or 2K for ``"silu_mul"``."""
    K = weights[0].shape[1]
    N = sum(w.shape[0] for w in weights)
    args = [
        x.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // x.shape[-1] if x.shape[-1] else 0, K, x.shape[-1],
        PROLOGUES[prologue], 0 if gamma is None else gamma.data_ptr(), _f32_bits(eps), y.data_ptr(), N,
        0 if residual is None else residual.data_ptr(), torch.get_num_threads(), len(weights),
    ]  # fmt: skip
    for w, b in zip(weights, biases, strict=True):
        args += [w.data_ptr(), DTYPE_CODES[w.dtype], w.shape[0], 0 if b is None else b.data_ptr()]
    vec = array("q", args)
    status = _lib().aipc_dense_linear_fused_v(vec.buffer_info()[0])
    if status != 0:
        raise RuntimeError(f"aipc_dense_linear_fused failed: {status_message(status)} (M={args[2]}, K={K}, N={N}, "
                           f"prologue {prologue}, x {x.dtype}, weights {[w.dtype for w in weights]})")  # fmt: skip
