"""What the low-bit kernels share: path selection, the activation rounding, split-K and its buffers.

Device side (``@triton.jit``): round-half-even and the int8 quantization of an activation, the
per-row absmax scales, and the split-K epilogue (store, or partials + last-program reduction with
an atomic ticket). Host side: the M -> path rule, the config fields each path needs, the split-K
plan and the per-stream ticket and atomic-sum buffers it uses, and the dense operands of a call
(:func:`dense_call`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.packing import PackedLowBit

GEMV_MAX_M = 16  # M up to this is the GEMV path (stream at M == 1, group split over K otherwise)
LOCK_SLOTS = 16384  # split-K tickets (output tiles) per stream
SUMS_MIN = 1 << 20  # fp32 elements of the atomic split-K buffer allocated at first use (M=16 x N=65536)
# the fields a config of each path must give (a kernel may read more, with defaults)
CONFIG_FIELDS = {"gemv": ("BLOCK_N", "SPLIT_K", "num_warps", "num_stages"), "gemm": ("BLOCK_N", "BLOCK_M", "num_warps", "num_stages")}


def path(M: int) -> str:
    """``"gemv"`` for M <= :data:`GEMV_MAX_M` tokens, else ``"gemm"``."""
    return "gemv" if M <= GEMV_MAX_M else "gemm"


def check_config(cfg: dict, M: int, fields: Optional[tuple[str, ...]] = None) -> dict:
    """``cfg`` if it gives every field of M's path (or the kernel's own ``fields``), else a ValueError
    naming the missing ones."""
    need = fields or CONFIG_FIELDS[path(M)]
    missing = [f for f in need if f not in cfg]
    if missing:
        raise ValueError(f"config={cfg} lacks {missing} for the {cfg.get('KERNEL', path(M))} kernel; give {need}")
    return cfg


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def pick(q: tl.constexpr, v0, v1, v2, v3):
    """``v<q>`` for a compile-time index ``q`` (0-3): a bit-plane's value among four."""
    if q == 0:
        return v0
    elif q == 1:
        return v1
    elif q == 2:
        return v2
    else:
        return v3


@triton.jit
def rne(v):
    """Round half to even for |v| < 2**22 (torch.round's rounding, no libdevice needed)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 ``v`` rounded to nearest-even in ``dtype``; bf16 by its bits (the Triton interpreter's
    fp32 -> bf16 conversion truncates; finite values only, as dequantized weights are)."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def quantize(xv, inv):
    """int8 code (as fp32) of ``xv``: rne(fp32(xv * inv)). The product goes through an fma with 0 so
    the compiler cannot contract it into the rounding add (that would skip the product's rounding)."""
    return rne(tl.fma(xv, inv, 0.0))


@triton.jit
def act_scales(x_ptr, offs_m, m_mask, K, BLOCK_M: tl.constexpr, BLOCK_KX: tl.constexpr):
    """Per-row absmax of x[M, K] -> (127 / absmax or 0, absmax / 127), both fp32 [BLOCK_M]."""
    offs = tl.arange(0, BLOCK_KX)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_KX):
        k = k0 + offs
        xv = tl.load(x_ptr + offs_m[:, None] * K + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(xv.to(tl.float32)), axis=1))
    safe = tl.where(amax > 0, amax, 1.0)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), safe), 0.0)
    return inv, tl.math.div_rn(amax, tl.full([BLOCK_M], 127.0, tl.float32))


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile ``pid`` of an [M, N] result in grouped order (GROUP_M row blocks share their weight
    columns in L2): ``(offs_m, offs_n, m_mask, n_mask, rm, rn)``, ``rm`` / ``rn`` the offsets clamped into
    range (unmasked loads; the results past M / N are dropped at the store)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    return offs_m, offs_n, m_mask, n_mask, tl.where(m_mask, offs_m, 0), tl.where(n_mask, offs_n, 0)


@triton.jit
def fence_gpu(v):
    """``v``, after a GPU-scope fence by every thread: its writes (atomic adds included) are visible
    device-wide before the barrier and ticket that follow (CUDA only: PTX)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, offs, mask, split_stride, pid_k, lock_idx,
                    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr = False,
                    FENCE: tl.constexpr = False):
    """Writes the fp32 tile ``acc`` (+ ``bias``, broadcast like ``acc``) to ``y[offs]``. With split-K:
    this program's partial goes to the workspace (``ws[pid_k * split_stride + offs]``) and the last
    program of the tile (atomic ticket ``lock[lock_idx]``) sums the partials, adds the bias, stores y and
    re-arms the ticket (one launch, no zero-fill: CUDA-graph safe). ``ATOMIC``: the partials are
    instead added (fp32 atomics, in arrival order: not bit-reproducible) into one zeroed ``ws[offs]``
    tile, which the last program takes (atomic exchange with 0: the buffer is zero again) and stores
    to y. ``FENCE`` (compiled CUDA): every thread fences its partial writes before the ticket, the
    CUDA pattern for a last-block reduction."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if ATOMIC:
            tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(ws_ptr + pid_k * split_stride + offs, acc, mask=mask)
        if FENCE:
            lock_idx = fence_gpu(lock_idx)
        tl.debug_barrier()
        ticket = tl.atomic_add(lock_ptr + lock_idx, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            if ATOMIC:  # read and zero in one atomic (a load then a store raced between threads), on the
                # int32 bits: the interpreter has no fp32 exchange
                bits = tl.atomic_xchg(ws_ptr.to(tl.pointer_type(tl.int32)) + offs, tl.zeros_like(acc).to(tl.int32, bitcast=True), mask=mask, sem="relaxed")
                tot = bits.to(tl.float32, bitcast=True)
            else:
                tot = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT_K):
                    tot += tl.load(ws_ptr + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += bias
            tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + lock_idx, 0)


# ----------------------------------------------------------------------------- split-K buffers

_locks: dict[tuple, torch.Tensor] = {}
_sums: dict[tuple, torch.Tensor] = {}


def stream_key(device: torch.device) -> tuple:
    """``(device, id of its current stream)``: the split-K buffers are per stream, so kernels running on
    two streams at once never share a ticket or an atomic sum (kernels of one stream run in order)."""
    if device.type in ("cuda", "xpu"):
        stream = getattr(torch, device.type).current_stream(device)
        return device, int(getattr(stream, "stream_id", id(stream)))
    return device, 0  # the interpreter: one host thread


def lock_buffer(device: torch.device) -> torch.Tensor:
    """The current stream's split-K tickets on ``device`` (int32, zero when idle: the reducing program
    re-arms its own)."""
    key = stream_key(device)
    if key not in _locks:
        _locks[key] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return _locks[key]


def zeroed_sums(device: torch.device, numel: int) -> Optional[torch.Tensor]:
    """The current stream's zeroed fp32 buffer on ``device`` that atomic split-K adds partials into (the
    reducing program zeroes its tile again), grown to ``numel``; ``None`` where it would have to grow
    during a CUDA graph capture (memory allocated there belongs to the graph)."""
    key = stream_key(device)
    buf = _sums.get(key)
    if buf is None or buf.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _sums[key] = torch.zeros(max(numel, SUMS_MIN), dtype=torch.float32, device=device)
    return buf


def k_splits(tiles: int, chunks: int, most: int, programs: int) -> int:
    """The untuned split-K: doubled from 1 while below ``most``, the ``tiles`` output tiles times the
    split give fewer than ``programs`` programs and every split keeps at least two of the ``chunks``."""
    split = 1
    while split < most and tiles * split < programs and chunks >= 2 * split:
        split *= 2
    return split


def split_plan(chunks: int, split: int, tiles: int, M: int, N: int, dummy: torch.Tensor, atomic: bool = False):
    """``(splits, chunks per split, partials workspace, tickets, atomic)`` for ``split`` requested
    K-splits of ``chunks`` chunks over ``tiles`` output tiles: no empty splits, no split when the tiles
    outnumber the split-K tickets; unsplit, the workspace and tickets are ``dummy`` (never touched).
    ``atomic`` (partials added by fp32 atomics into one zeroed buffer) holds unless
    ``torch.use_deterministic_algorithms`` is on, the device is an XPU (not run there) or the buffer
    would grow inside a graph capture."""
    if tiles > LOCK_SLOTS:
        split = 1
    per_split = -(-chunks // split)
    split = -(-chunks // per_split)  # no empty splits
    if split == 1:
        return 1, chunks, dummy, dummy, False
    if atomic and dummy.device.type != "xpu" and not torch.are_deterministic_algorithms_enabled():
        sums = zeroed_sums(dummy.device, M * N)
        if sums is not None:
            return split, per_split, sums, lock_buffer(dummy.device), True
    ws = torch.empty(split * M * N, dtype=torch.float32, device=dummy.device)
    return split, per_split, ws, lock_buffer(dummy.device), False


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or sub-slices (XPU) of ``device``; 4 in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        return getattr(torch.xpu.get_device_properties(device), "gpu_subslice_count", 64)
    return 4


def dense_call(x: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], out: Optional[torch.Tensor]):
    """The operands of a Triton linear as the kernels read them: ``x`` flattened to dense ``[M, K]``, the
    output ``y [M, N]`` (a new tensor, or ``out``: contiguous, x's dtype, ``M * N`` elements, on x's
    device), a dense bias and the weight's tensors made dense. Returns ``(x2, weight, bias, y)``."""
    K, N = x.shape[-1], weight.out_features
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if out is None:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.dtype != x.dtype or out.numel() != M * N or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of {M * N} elements on {x.device}")
    else:
        y = out.view(M, N)
    bias = None if bias is None else bias.contiguous()
    weight = PackedLowBit(
        weight.layout, weight.qweight.contiguous(), weight.scales.contiguous(),
        None if weight.zeros is None else weight.zeros.contiguous(),
        weight.codebook, weight.group_size, weight.out_features, weight.in_features,
        None if weight.supers is None else weight.supers.contiguous(),
    )  # fmt: skip
    return x2, weight, bias, y
