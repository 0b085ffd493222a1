"""``expand``'s int8 GEMM on Hopper in Gluon, warp-specialized: a TMA producer and wgmma consumers.

``y = (xq @ w8^T) * sx[m] * s0[n] (+ bias)``, both operands int8 and K-contiguous, int32 over the whole K: the
same exact sums, float conversion and two products as :func:`.expand._int8_gemm_kernel`, so the same bits.
Triton 3.6 keeps every int8 wgmma synchronous (its ``warp_group_dot_wait`` has ``pendings = 0`` for int8
operands), and a kernel whose warps both copy and multiply pays a CTA barrier a step (the Gluon GEMM of 64bd57d).
Here a producer partition of ``PW`` warps only issues the TMA copies of each K step's two tiles into a ring of
``num_stages`` slots, handed over by mbarriers (``ready``: the step's bytes have landed; ``empty``: the wgmma that
read the slot has retired); the kernel's own warps only wait, issue the step's wgmma asynchronously, keep one in
flight and release the slot of the step before.

Config (``expand``'s, with ``WS=1``): ``BLOCK_M`` (16 rows a warp: 64 for 4 warps, 128 for 8), ``BLOCK_N`` (a multiple
of 16 up to 256), ``BLOCK_K`` (128), ``num_warps`` (4 or 8), ``num_stages`` (slots, >= 2), ``GROUP_M``, ``PW`` and
``PRODUCER_REGS`` (the producer's warps and registers, default 4 and 40), ``PERSISTENT`` (default 0, a program a tile;
1: a program an SM taking output tiles in turn, the producer's ring running on across them, so the next tile's first
steps load under this tile's last wgmmas and epilogue). CUDA with compute capability 9.x, compiled (:func:`usable`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from aipc_kernels.gpu.triton.lowbit.common import sm_count
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED

# Triton 3.6's name of the TMA load; 3.9 keeps only async_load (same arguments)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


# the Gluon API the kernel is written for (warp_specialize taking (function, args) pairs): Triton 3.6 and later
_GLUON_API = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 6)


def usable(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA of compute capability 9.x (wgmma, TMA), compiled, Triton >= 3.6."""
    return (device.type == "cuda" and not INTERPRETED and _GLUON_API
            and torch.cuda.get_device_capability(device)[0] == 9)


def check(device: torch.device, cfg: dict) -> None:
    """ValueError unless ``cfg`` is a tile this kernel takes, on a device it runs on."""
    bm, bn, bk, nw, ns = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]
    if nw not in (4, 8) or bm != 16 * nw or bn % 16 or not 16 <= bn <= 256 or bk != 128 or ns < 2:
        raise ValueError(f"expand: WS=1 takes BLOCK_M = 16 * num_warps (num_warps 4 or 8), BLOCK_N a multiple of 16 up to "
                         f"256, BLOCK_K 128 and num_stages >= 2; config {cfg} is not one: use WS=0")  # fmt: skip
    if cfg.get("PERSISTENT", 0) not in (0, 1):
        raise ValueError(f"expand: WS=1 takes PERSISTENT 0 (a program a tile) or 1 (a program an SM); not "
                         f"{cfg['PERSISTENT']!r}")  # fmt: skip
    if not usable(device):
        raise ValueError(f"expand: WS=1 is a Gluon kernel for CUDA GPUs of compute capability 9.x, compiled; x is on "
                         f"{device}{' under the Triton interpreter' if INTERPRETED else ''}: use WS=0")  # fmt: skip


@gluon.constexpr_function
def _instr_n(block_n):
    """The wgmma N of int8 operands dividing ``block_n``: at most 224 and a multiple of 16 (the PTX shapes)."""
    n = 224
    while block_n % n:
        n -= 16
    return n


@gluon.jit
def _tile(t, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """``(off_m, off_n)`` of output tile ``t`` in grouped order (GROUP_M row blocks share their weight columns in L2)."""
    num_m = gl.cdiv(M, BLOCK_M)
    width = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (t // width) * GROUP_M
    gsz = gl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (t % width) % gsz) * BLOCK_M, ((t % width) // gsz) * BLOCK_N


@gluon.jit
def _loader(a_ring, b_ring, ready, empty, xq_desc, w8_desc, M, N, steps, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NS: gl.constexpr):  # fmt: skip
    """Producer partition: the program's tiles in turn, each K step's token-code and level tiles by TMA into the
    ring's next slot once it is free (the ring runs on across tiles: the next tile's first steps load during this
    tile's last wgmmas and epilogue)."""
    g = 0
    for t in range(gl.program_id(0), gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N), gl.num_programs(0)):
        off_m, off_n = _tile(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for i in range(steps):
            s = g % NS
            mbarrier.wait(empty.index(s), ((g // NS) & 1) ^ 1)  # released by the consumer (free at first)
            mbarrier.expect(ready.index(s), xq_desc.block_type.nbytes + w8_desc.block_type.nbytes)
            _tma_load(xq_desc, [off_m, i * BLOCK_K], ready.index(s), a_ring.index(s))
            _tma_load(w8_desc, [off_n, i * BLOCK_K], ready.index(s), b_ring.index(s))
            g += 1


@gluon.jit
def _mma(a_ring, b_ring, ready, empty, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, stride_ym, steps, HAS_BIAS: gl.constexpr,
         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NS: gl.constexpr,
         num_warps: gl.constexpr):  # fmt: skip
    """Consumer partition (the kernel's warps), per tile of the program: per K step, wait for the slot, the wgmma
    issued asynchronously, the previous step's slot released once its wgmma has retired (the tile's last slot after
    the final wait); then the epilogue."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, _instr_n(BLOCK_N), 32])  # fmt: skip
    g = 0
    for t in range(gl.program_id(0), gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N), gl.num_programs(0)):
        off_m, off_n = _tile(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=mma_layout)
        for i in range(steps):
            s = g % NS
            mbarrier.wait(ready.index(s), (g // NS) & 1)
            acc = warpgroup_mma(a_ring.index(s), b_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((g + NS - 1) % NS), pred=i > 0)  # step g - 1's wgmma has retired
            g += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((g + NS - 1) % NS))  # the tile's last step
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        rmask = rows < M
        cmask = cols < N
        sx = gl.load(sx_ptr + rows, mask=rmask, other=0.0)
        s0 = gl.load(s0_ptr + cols, mask=cmask, other=0.0)
        out = acc.to(gl.float32) * sx[:, None] * s0[None, :]
        if HAS_BIAS:
            out += gl.load(b_ptr + cols, mask=cmask, other=0.0).to(gl.float32)[None, :]
        offs = rows.to(gl.int64)[:, None] * stride_ym + cols[None, :]
        gl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@gluon.jit
def _int8_gemm_ws_kernel(xq_desc, w8_desc, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp, stride_ym, HAS_BIAS: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                         NS: gl.constexpr, PW: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         num_warps: gl.constexpr):  # fmt: skip
    """Program p takes output tiles p, p + programs, ... (one each when there are as many programs as tiles)."""
    a_ring = gl.allocate_shared_memory(gl.int8, [NS, BLOCK_M, BLOCK_K], xq_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.int8, [NS, BLOCK_N, BLOCK_K], w8_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    steps = Kp // BLOCK_K
    gl.warp_specialize([
        (_mma, (a_ring, b_ring, ready, empty, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, stride_ym, steps, HAS_BIAS, BLOCK_M,
                BLOCK_N, GROUP_M, NS, num_warps)),
        (_loader, (a_ring, b_ring, ready, empty, xq_desc, w8_desc, M, N, steps, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                   NS)),
    ], [PW], [PRODUCER_REGS])  # fmt: skip


def launch_gemm(xq: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, n: int, s0: torch.Tensor,
                bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict) -> None:  # fmt: skip
    """``y[:, :n] = (xq @ w8[:n]^T) * sx * s0[:n] (+ bias[:n])`` for ``xq [M, Kp]`` and ``w8 [>= n, Kp]`` int8
    (K-contiguous; ``y`` may be a column slice), on a ``cfg`` that :func:`check` has passed (``expand.launch`` checks
    it once, before its activation pass, not per row chunk)."""
    M, Kp = xq.shape
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]

    def desc(t: torch.Tensor, rows: int, block: list[int]) -> TensorDescriptor:
        return TensorDescriptor(t, [rows, Kp], [Kp, 1], block, gl.NVMMASharedLayout.get_default_for(block, gl.int8))

    tiles = triton.cdiv(M, bm) * triton.cdiv(n, bn)
    _int8_gemm_ws_kernel[(min(tiles, sm_count(xq.device)) if cfg.get("PERSISTENT") else tiles,)](
        desc(xq, M, [bm, bk]), desc(w8, n, [bn, bk]), sx, s0, s0 if bias is None else bias, y, M, n, Kp, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8),
        NS=cfg["num_stages"], PW=cfg.get("PW", 4), PRODUCER_REGS=cfg.get("PRODUCER_REGS", 40), num_warps=cfg["num_warps"],
        **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {}),
    )  # fmt: skip
