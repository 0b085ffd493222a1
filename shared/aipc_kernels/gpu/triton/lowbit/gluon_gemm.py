"""The int8 GEMM of the ``expand`` path on Hopper, in Gluon: wgmma kept in flight while the next tiles load.

``y = (xq @ w8^T) * sx[m] * s0[n] (+ bias)``, both operands int8 and K-contiguous, int32 over the whole K.
Triton 3.6's pipeliner leaves every int8 wgmma synchronous (its ``warp_group_dot_wait`` has ``pendings = 0``
for int8 operands, 1 for fp16: the tensor cores idle while each step's wait, barrier and next issue run);
Gluon states the schedule itself. Per K step of ``BLOCK_K``: the tiles of step ``i + STAGES - 2`` are copied
(``cp.async``, 16 bytes a thread) into the ring slot that the wgmma of step ``i - 2`` read, then step ``i``'s
wgmma is issued asynchronously and the kernel waits until only it is outstanding (so step ``i - 1``'s is
done). One CTA barrier a step: after it every thread's copies of step ``i`` have landed and every warpgroup
has retired the wgmma of step ``i - 2``, whose slot is then refilled. Same values as the Triton kernel: each
output is one exact int32 sum, one float conversion and two products.

Config (``expand``'s, with ``GLUON=1``): ``BLOCK_M`` (64 per 4 warps), ``BLOCK_N`` (<= 256), ``BLOCK_K`` (128),
``num_warps`` (4 or 8), ``num_stages`` (the ring's slots, >= 3), ``GROUP_M``. CUDA with compute capability
9.x only (:func:`usable`).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED

# Triton 3.6's names; later releases call them async_load and barrier (same arguments)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def usable(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA, compute capability 9.x (wgmma), not interpreted."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] == 9


def check(M: int, N: int, Kp: int, cfg: dict) -> None:
    """ValueError unless ``cfg`` gives a tile this kernel takes for ``Kp``."""
    bm, bn, bk, nw, ns = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]
    if nw not in (4, 8) or bm != 16 * nw * (bm // (16 * nw)) or bm % 64 or bn % 16 or bn > 256 or Kp % bk or bk % 16:
        raise ValueError(f"gluon int8 GEMM: config {cfg} is not a tile it takes (BLOCK_M a multiple of 16 * num_warps and "
                         f"of 64, num_warps 4 or 8, BLOCK_N a multiple of 16 up to 256, BLOCK_K dividing K={Kp})")  # fmt: skip
    if ns < 3:
        raise ValueError(f"gluon int8 GEMM: num_stages={ns}: the ring needs >= 3 slots (one being read, one landing, one free)")


@gluon.constexpr_function
def _instr_n(block_n):
    """The wgmma N of int8 operands dividing ``block_n``: at most 224 and a multiple of 16 (the PTX shapes)."""
    n = 224
    while block_n % n:
        n -= 16
    return n


@gluon.jit
def _int8_gemm_kernel(xq_ptr, sx_ptr, w8_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp, HAS_BIAS: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y in grouped order (GROUP_M row blocks share their weight columns in L2)."""
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = gl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % width) % gsz) * BLOCK_M
    off_n = ((pid % width) // gsz) * BLOCK_N

    # cp.async of a [rows, BLOCK_K] int8 tile: 16 bytes a thread, a warp's lanes along K then rows
    TPK: gl.constexpr = BLOCK_K // 16
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPK, TPK], [num_warps, 1], [1, 0])
    a_rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    b_rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    kk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
    a_ptrs = xq_ptr + gl.minimum(a_rows, M - 1).to(gl.int64)[:, None] * Kp + kk[None, :]
    b_ptrs = w8_ptr + gl.minimum(b_rows, N - 1).to(gl.int64)[:, None] * Kp + kk[None, :]

    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.int8)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.int8)
    a_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, _instr_n(BLOCK_N), 32])  # fmt: skip
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=mma_layout)

    steps = Kp // BLOCK_K
    for s in gl.static_range(STAGES - 2):  # the first STAGES - 2 steps in flight
        live = s < steps
        _async_load(a_ring.index(s), a_ptrs + s * BLOCK_K, mask=live)
        _async_load(b_ring.index(s), b_ptrs + s * BLOCK_K, mask=live)
        async_copy.commit_group()
    for i in range(steps):
        async_copy.wait_group(STAGES - 3)  # this thread's copies of step i have landed
        fence_async_shared()  # and are visible to the async proxy (the wgmma's reads)
        _cta_barrier()  # everyone's; and every warpgroup has retired step i - 2's wgmma
        nxt = i + STAGES - 2
        slot = nxt % STAGES
        _async_load(a_ring.index(slot), a_ptrs + nxt * BLOCK_K, mask=nxt < steps)
        _async_load(b_ring.index(slot), b_ptrs + nxt * BLOCK_K, mask=nxt < steps)
        async_copy.commit_group()
        cur = i % STAGES
        acc = warpgroup_mma(a_ring.index(cur), b_ring.index(cur).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)

    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    rmask = rows < M
    cmask = cols < N
    sx = gl.load(sx_ptr + rows, mask=rmask, other=0.0)
    s0 = gl.load(s0_ptr + cols, mask=cmask, other=0.0)
    out = acc.to(gl.float32) * sx[:, None] * s0[None, :]
    if HAS_BIAS:
        out += gl.load(b_ptr + cols, mask=cmask, other=0.0).to(gl.float32)[None, :]
    offs = rows.to(gl.int64)[:, None] * N + cols[None, :]
    gl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def launch_gemm(xq: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, s0: torch.Tensor, bias, y: torch.Tensor,
                cfg: dict) -> None:  # fmt: skip
    """``y = (xq @ w8^T) * sx * s0 (+ bias)`` for ``xq [M, Kp]``, ``w8 [N, Kp]`` int8 (K-contiguous)."""
    M, Kp = xq.shape
    N = w8.shape[0]
    check(M, N, Kp, cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _int8_gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        xq, sx, w8, s0, s0 if bias is None else bias, y, M, N, Kp, HAS_BIAS=bias is not None, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg.get("GROUP_M", 8), STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
