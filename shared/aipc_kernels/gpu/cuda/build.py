"""Compiling the CUDA C kernels (``cuda_stream.cu``, ``cuda_mma.cu``) at first use: NVRTC through
``torch.cuda._compile_kernel`` (no CUDA toolkit on the user's machine), one compile per variant (a tuple
of macro values) and process. The source is the variant's ``#define``s, ``cuda_common.cuh`` (what the
kernels share), then the kernel's own file."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED

COMMON = Path(__file__).with_name("cuda_common.cuh")
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # IN_KIND / SCALE_KIND of a dtype
_compiled: dict[tuple, object] = {}
_lock = threading.Lock()


def nvrtc_available(device: torch.device) -> bool:
    """Compiled CUDA (not the Triton interpreter) with torch's NVRTC entry (``torch.cuda._compile_kernel``)."""
    return device.type == "cuda" and not INTERPRETED and torch.version.cuda is not None and hasattr(torch.cuda, "_compile_kernel")


def check_w2_operands(name: str, x2: torch.Tensor, weight, cfg: dict, available: bool, progressive: bool = False) -> None:
    """The refusals the 2-bit tensor-core kernels (``cuda_mma``, ``cuda_gemm``) share, each a ValueError naming
    the Triton ``group`` kernel: no compiled CUDA, not 2-bit codes in groups of 32/64/128, N % 8, misaligned or
    unsupported operands, the min form and float32 scales (GGUF's forms). ``progressive``: the kernel takes the
    progressive two-level form too (``weight.supers`` set: int8 scales and mins, float32 supers), which is then checked
    for those instead of refused as a min form. ``weight`` is a :class:`~aipc_kernels.lowbit.packing.PackedLowBit`."""
    cb = get_codebook(weight.codebook)
    G, N, K = weight.group_size, weight.out_features, x2.shape[1]
    if not available:
        raise ValueError(f"config {cfg}: {name} needs compiled CUDA on sm_80+ with torch.cuda._compile_kernel; use KERNEL='group'")
    if cb.bits != 2 or G not in (32, 64, 128) or G == K or N % 8:
        raise ValueError(f"config {cfg}: {name} takes 2-bit codes in groups of 32, 64 or 128 and N % 8 == 0 "
                         f"({weight.codebook}, {cb.bits} bits, group {G}, N={N}); use KERNEL='group'")
    form = progressive and weight.supers is not None  # the progressive form, for a kernel that takes it
    if form:
        if (weight.scales.dtype != torch.int8 or weight.zeros is None or weight.zeros.dtype != torch.int8
                or weight.supers.dtype != torch.float32):
            raise ValueError(f"config {cfg}: {name} takes the progressive form with int8 scales and mins and float32 "
                             f"supers; use KERNEL='group'")
    elif cb.mins or weight.scales.dtype == torch.float32:
        raise ValueError(f"config {cfg}: {name} takes neither the min form nor float32 scales (GGUF's Q4_1 / K-quants: "
                         f"{weight.codebook}, scales {weight.scales.dtype}); use KERNEL='group'")
    if (weight.qweight.data_ptr() % 16 or x2.dtype not in KINDS or (not form and weight.scales.dtype not in KINDS)
            or weight.scales.data_ptr() % 16 or (weight.zeros is not None and weight.zeros.data_ptr() % 16)):
        raise ValueError(f"config {cfg}: {name} needs 16-byte aligned codes, scales (and zeros) and fp32/fp16/bf16 x "
                         f"and scales (int8 in the progressive form); use KERNEL='group'")


def bias_operand(bias: Optional[torch.Tensor], x2: torch.Tensor, dummy: torch.Tensor) -> torch.Tensor:
    """The bias pointer the CUDA kernels take: they read the bias in x's dtype (``in_t``), and the op does not tie the
    two, so a bias of another dtype is converted to x's first (rounded once where x is narrower; a float32 bias beside
    bf16 x was read as bf16 halves); no bias: ``dummy``."""
    if bias is None:
        return dummy
    return bias if bias.dtype == x2.dtype else bias.to(x2.dtype)


def compiled(source: Path, kernel: str, names: tuple[str, ...], values: tuple, shared_mem: int = 0) -> object:
    """The kernel ``kernel`` of ``source`` compiled with ``#define name value`` for each pair (cached);
    ``shared_mem``: the dynamic shared memory its launches take (the values must decide it), opted in once
    at the compile where it is 48 KiB or more."""
    key = (source.name, kernel, values)
    with _lock:
        if key not in _compiled:
            defines = "".join(f"#define {n} {v}\n" for n, v in zip(names, values, strict=True))
            text = defines + COMMON.read_text() + source.read_text()
            kern = torch.cuda._compile_kernel(text, kernel, nvcc_options=["-std=c++17"])
            if shared_mem >= 48 * 1024:
                kern.set_shared_memory_config(shared_mem)
            _compiled[key] = kern
        return _compiled[key]


def float_literal(v: float) -> str:
    """``v`` as an exact C float literal for a macro (hexadecimal, cast to float)."""
    return f"((float){float(v).hex()})"
