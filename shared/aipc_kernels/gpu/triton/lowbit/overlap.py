"""``overlap``: prompts on the progressive two-level form (2-bit codes) in one Gluon kernel on Hopper, each K
step's int8 weight levels formed in registers and stored to a shared ring while the previous step's wgmma runs.

Same product as ``expand`` (:mod:`.expand`): ``y = (xq @ w8^T) * sx[m] * s0[n] (+ bias)``, ``w8 = s1 * c + m``
exact int8 (:mod:`aipc_kernels.lowbit.progressive`), int32 over the whole K, so each output is the same exact
int32 sum, one float conversion and two products in the same order: bit-identical to ``expand`` and the fused
``progressive`` kernel. What differs is where the levels are formed. ``expand`` writes all of them to global
memory in a pass of its own (8B gate/up: 59 MB) that the GEMM reads back; ``progressive`` forms them in the
warps that issue the MMAs, and Triton 3.6 keeps every int8 wgmma synchronous, so forming and multiplying take
turns. Here the schedule is written out (Gluon): per K step ``i`` of 128 k (one 32-byte chunk of a row's 2-bit
codes), every thread forms its share of step ``i``'s [BLOCK_N, 128] levels from code bytes loaded a step
earlier (inline PTX on four codes a register: shift, mask, multiply by ``s1``, byte-wise add of ``m + 128``,
sign flip) and stores them to slot ``i % 3`` of a shared ring, while step ``i - 1``'s wgmma, issued
asynchronously, is still running on the tensor cores; the token codes arrive by ``cp.async`` in a ring of
``num_stages`` slots. One CTA barrier a step, after which step ``i``'s wgmma is issued and the kernel waits
until only it is outstanding. A slot of levels is rewritten three steps after its wgmma was issued, a slot of
token codes ``num_stages - 2`` steps after: both retired by then in every warpgroup.

Config: ``BLOCK_M`` (16 rows per warp: 64 for 4 warps, 128 for 8, 256 for 16), ``BLOCK_N`` (multiple of 16, <= 256),
``num_warps`` (4, 8 or 16), ``num_stages`` (token-code slots, >= 3), ``GROUP_M`` (default 8), ``MAXNREG`` (the
registers a thread may use: 128 lets two 8-warp 128 x 128 programs share an SM). CUDA with compute capability 9.x
only (:func:`usable`); 2-bit codes, groups of 32, 64 or 128.

Two other schedules of the same product: ``WS=1`` warp-specialized (:func:`_overlap_ws_kernel`: a producer partition
of ``PW`` warps, ``PARTS`` of them taking the steps in turn, gets the code bytes, scales and mins by TMA ``D`` steps
ahead and the token codes by TMA, forms the levels and stores them into an ``num_stages``-slot ring handed over by
mbarriers; the kernel's warps only issue wgmmas; ``PRODUCER_REGS`` its registers, N % 16 == 0) and ``RS=1``
(:func:`_overlap_rs_kernel`: the levels formed in registers as the wgmma's A operand, weights as the MMA's M, one k32
wgmma per bit-plane, a 1-warp TMA loader of the token codes). ``PROBE`` (timing only, wrong outputs): 1 leaves out
the producer's store of the levels, 2 the consumer's wgmma. All lost to ``expand`` on an H100 (docs/triton.md,
Tried and lost).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from aipc_kernels.lowbit.packing import PackedLowBit
from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
from aipc_kernels.gpu.triton.lowbit.common import path
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED
from aipc_kernels.gpu.triton.lowbit.progressive import MAX_K, levels_asm

NAME = "overlap"
FORMS = ("progressive",)  # a kernel of the progressive two-level form (registry.takes), and only of it
FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
# (BLOCK_M, BLOCK_N, num_warps, num_stages, MAXNREG): the levels of a weight tile serve BLOCK_M tokens, so the
# forming costs 1 / BLOCK_M of the MMAs' work; 16 warps (four warpgroups of 64 tokens) share it out the most thinly
_TILES = [(256, 128, 16, 3, None), (256, 128, 16, 4, None), (128, 128, 8, 4, 128), (128, 128, 8, 3, 128),
          (128, 128, 8, 4, None), (128, 256, 8, 3, None), (64, 128, 4, 4, None)]  # fmt: skip
SPACE = [{"KERNEL": NAME, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": nw, "num_stages": ns, **({"MAXNREG": r} if r else {})}
         for bm, bn, nw, ns, r in _TILES]  # fmt: skip
GROUPS = (32, 64, 128)
# Triton 3.6's name; later releases call it async_load (same arguments)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
def usable(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA, compute capability 9.x (wgmma), not interpreted."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] == 9


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """ValueError unless the weight is the progressive form in 2-bit codes with groups of 32 / 64 / 128, ``cfg``
    gives a tile this kernel takes and ``x2`` is on a device it runs on."""
    if weight.supers is None or weight.scales.dtype != torch.int8 or weight.bits != 2 or weight.group_size not in GROUPS:
        raise ValueError(f"config KERNEL={NAME!r} takes the progressive two-level form in 2-bit codes with groups of "
                         f"{GROUPS} (int8 scales and mins, one s0 per row); this weight has {weight.codebook!r}, "
                         f"{weight.bits}-bit, group {weight.group_size}, {weight.scales.dtype} scales: use KERNEL='expand'")  # fmt: skip
    bm, bn, nw, ns = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
    if cfg.get("RS"):  # weights are the MMA's M (16 rows a warp), tokens its N
        bm, bn = bn, bm
    if nw not in (4, 8, 16) or bm != 16 * nw or bn % 16 or not 16 <= bn <= 256:
        raise ValueError(f"{NAME}: config {cfg} is not a tile it takes: BLOCK_M = 16 * num_warps (num_warps 4, 8 or 16), "
                         f"BLOCK_N a multiple of 16 up to 256")  # fmt: skip
    if cfg.get("WS") and (weight.out_features % 16 or any(t.data_ptr() % 16 for t in (weight.qweight, weight.scales, weight.zeros))):
        raise ValueError(f"{NAME}: WS=1 loads the codes, scales and mins by TMA: N={weight.out_features} must be a multiple "
                         f"of 16 and the tensors 16-byte aligned; use WS=0")  # fmt: skip
    if ns < (2 if cfg.get("WS") or cfg.get("RS") else 3):
        raise ValueError(f"{NAME}: num_stages={ns}: the token codes' ring needs >= 3 slots (one read, one landing, one free)")
    if x2.shape[1] > MAX_K:
        raise ValueError(f"{NAME}: K={x2.shape[1]} over {MAX_K}: the whole-K int32 accumulator could overflow")
    if not usable(x2.device):
        raise ValueError(f"{NAME}: a Gluon kernel for CUDA GPUs of compute capability 9.x (wgmma), compiled; x is on "
                         f"{x2.device}{' under the Triton interpreter' if INTERPRETED else ''}: use KERNEL='expand'")  # fmt: skip


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens: prompts, on a CUDA GPU of compute capability 9.x."""
    if path(M) != "gemm" or not torch.cuda.is_available() or not usable(torch.device("cuda")):
        return []
    return SPACE


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned default: 128 x 128 tiles of 8 warps, 4 slots of token codes."""
    return dict(SPACE[0])


@gluon.constexpr_function
def _instr_n(block_n):
    """The wgmma N of int8 operands dividing ``block_n``: at most 224 and a multiple of 16 (the PTX shapes)."""
    n = 224
    while block_n % n:
        n -= 16
    return n


@gluon.jit
def _step_loads(w_words, s_ptr, m_ptr, rn, rq, jw, c, N, NG, G: gl.constexpr):
    """Chunk ``c``'s operands of :func:`_levels`: its code words ``[BLOCK_N, 1, 8]`` (each row's 32 bytes) and,
    per row and bit-plane, the plane's group's ``s1`` and ``(m + 128) * 0x01010101`` as uint32 ``[BLOCK_N, 4, 1]``
    (``rn``, ``rq``: the rows and planes, ``[BLOCK_N, 1]`` / ``[1, 4]``; past K, in the padded chunk: the last
    group)."""
    wv = gl.load(w_words + c * 8 + jw)
    g = gl.minimum((c * 128 + rq * 32) // G, NG - 1)  # [1, 4]: the group of each plane
    s1 = gl.load(s_ptr + g * N + rn).to(gl.uint8, bitcast=True).to(gl.uint32)
    mb = (gl.load(m_ptr + g * N + rn).to(gl.int32) + 128).to(gl.uint32) * 0x01010101
    return wv, gl.expand_dims(s1, 2), gl.expand_dims(mb, 2)


@gluon.jit
def _levels(wv, s1, mb, shift):
    """The int8 levels + the sign flip as ``[BLOCK_N, 4, 8]`` uint32 words: word (n, q, j) holds k = 32 q + 4 j .. + 3
    of bit-plane ``q`` of code word ``j``, ``((c >> 2q) & 3) * s1 + m + 128`` byte-wise (the form bounds ``c * s1``
    and the level + 128 to a byte: nothing carries across bytes), each byte's sign bit then flipped."""
    return (((wv >> shift) & 0x03030303) * s1 + mb) ^ 0x80808080


@gluon.jit
def _overlap_kernel(xq_ptr, sx_ptr, w_ptr, s_ptr, m_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp, KB, NG,
                    G: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y in grouped order (GROUP_M row blocks share their weight columns in L2)."""
    BLOCK_K: gl.constexpr = 128
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = gl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % width) % gsz) * BLOCK_M
    off_n = ((pid % width) // gsz) * BLOCK_N

    # cp.async of the [BLOCK_M, 128] token codes: 16 bytes a thread, a warp's lanes along K then rows
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    a_rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    ka = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
    a_ptrs = xq_ptr + gl.minimum(a_rows, M - 1).to(gl.int64)[:, None] * Kp + ka[None, :]
    # the weight's levels as [BLOCK_N, 4, 8] words (row, bit-plane, code word): a thread owns one plane's 8 words
    lv_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])
    rq_layout: gl.constexpr = gl.SliceLayout(2, lv_layout)  # [BLOCK_N, 4]
    rn = gl.minimum(off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rq_layout)), N - 1)[:, None]
    rq = gl.arange(0, 4, layout=gl.SliceLayout(0, rq_layout))[None, :]
    jw = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, lv_layout))), 0), 1)
    w_words = w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True) + gl.expand_dims(rn.to(gl.int64) * (KB // 4), 2)
    shift = gl.expand_dims((2 * rq).to(gl.uint32), 2)

    a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.int8)
    b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.int8)
    w_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K // 4], gl.uint32)
    a_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_smem)
    b_ring = gl.allocate_shared_memory(gl.uint32, [3, BLOCK_N, BLOCK_K // 4], w_smem)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, _instr_n(BLOCK_N), 32])  # fmt: skip
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=mma_layout)

    steps = Kp // BLOCK_K
    for s in gl.static_range(STAGES - 2):  # the first STAGES - 2 steps' token codes in flight
        _async_load(a_ring.index(s), a_ptrs + s * BLOCK_K, mask=s < steps)
        async_copy.commit_group()
    wv, s1, mb = _step_loads(w_words, s_ptr, m_ptr, rn, rq, jw, 0, N, NG, G)
    for i in range(steps):
        # the next step's code words and scales in flight; step i's levels formed while step i - 1's wgmma runs
        nv, n1, nb = _step_loads(w_words, s_ptr, m_ptr, rn, rq, jw, gl.minimum(i + 1, steps - 1), N, NG, G)
        lv = gl.reshape(_levels(wv, s1, mb, shift), [BLOCK_N, BLOCK_K // 4])
        wv, s1, mb = nv, n1, nb
        b_ring.index(i % 3).store(lv)  # last read by step i - 3's wgmma, retired by every warpgroup before barrier i - 1
        async_copy.wait_group(STAGES - 3)  # this thread's token codes of step i have landed
        fence_async_shared()  # they and the stored levels are visible to the async proxy (the wgmma's reads)
        _cta_barrier()  # everyone's; and every warpgroup has retired step i - 2's wgmma, whose token slot is refilled
        nxt = i + STAGES - 2
        _async_load(a_ring.index(nxt % STAGES), a_ptrs + nxt * BLOCK_K, mask=nxt < steps)
        async_copy.commit_group()
        b = b_ring.index(i % 3)._reinterpret(gl.int8, [BLOCK_N, BLOCK_K], b_smem)
        acc = warpgroup_mma(a_ring.index(i % STAGES), b.permute((1, 0)), acc, is_async=True)
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


@gluon.jit
def _issue_codes(w_desc, s_desc, m_desc, ready_c, c_ring, s_ring, m_ring, j, slot, off_n, pred, GPS: gl.constexpr):
    """TMA of step ``j``'s code bytes [BLOCK_N, 32] and of an 8-row box of group scales and mins [8, BLOCK_N] whose
    first GPS rows are the step's groups, into ``slot``."""
    bar = ready_c.index(slot)
    mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * s_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, j * 32], bar, c_ring.index(slot), pred=pred)
    tma.async_copy_global_to_shared(s_desc, [j * GPS, off_n], bar, s_ring.index(slot), pred=pred)
    tma.async_copy_global_to_shared(m_desc, [j * GPS, off_n], bar, m_ring.index(slot), pred=pred)


@gluon.jit
def _box_rows(box, sel):
    """The first GPS rows of an [8, BLOCK_N] box as [BLOCK_N, GPS] int32: each row's 8 values (``box``, loaded as
    [BLOCK_N, 1, 8]) summed under the one-hot ``sel`` [1, GPS, 8]."""
    return gl.sum(gl.where(sel, box.to(gl.int32), 0), axis=2)


@gluon.jit
def _ws_levels(b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc, s_desc,
               m_desc, steps, off_m, off_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
               GPS: gl.constexpr, D: gl.constexpr, PW: gl.constexpr, PROBE: gl.constexpr, PART: gl.constexpr,
               PARTS: gl.constexpr):  # fmt: skip
    """Producer partition: the code bytes, group scales and mins by TMA ``D - 1`` steps ahead into a ring of its own
    (no global load of its own: its proxy fence would wait for every one in flight); per K step, once the consumer has
    released ring slot ``i % NS``, the token codes by TMA and the weight's levels formed and stored there."""
    BLOCK_K: gl.constexpr = 128
    PPG: gl.constexpr = 4 // GPS  # bit-planes per group within a step
    # levels as [BLOCK_N, GPS, PPG, 8] words (row, group, plane in group, code word): a thread owns one plane's 8 words
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [8, GPS, PPG, 1], [PW, 1, 1, 1], [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [BLOCK_N, GPS, PPG]
    words_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(1, L4))  # [BLOCK_N, 8]
    # the scale boxes read as [BLOCK_N, GPS, 8] (row, group, box row), each thread a row's 8 values per group
    LS: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, GPS, PPG], [PW, 1, 1], [2, 1, 0])  # rows and groups as L3's
    box_layout: gl.constexpr = gl.SliceLayout(1, LS)  # [BLOCK_N, 8]
    gsel = gl.expand_dims(gl.expand_dims(gl.arange(0, GPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS))), 0), 2)
    rsel = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS))), 0), 1)
    sel = gsel == rsel  # [1, GPS, 8]
    gi = gl.expand_dims(gl.expand_dims(gl.arange(0, GPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2)
    pi = gl.expand_dims(gl.expand_dims(gl.arange(0, PPG, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    shift = gl.expand_dims((2 * (gi * PPG + pi)).to(gl.uint32), 3)  # [1, GPS, PPG, 1]: 2 q for bit-plane q
    cw_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 8], gl.uint32)
    # PARTS producers take turns by step; each issues its own steps' codes D - PARTS steps ahead
    for j in gl.static_range(PART, D - PARTS, PARTS):
        _issue_codes(w_desc, s_desc, m_desc, ready_c, c_ring, s_ring, m_ring, j, j, off_n, j < steps, GPS)
    for i in range(PART, steps, PARTS):
        # step i + D - PARTS's codes into the slot this producer's previous step read (ordered by the fence and arrive below)
        _issue_codes(w_desc, s_desc, m_desc, ready_c, c_ring, s_ring, m_ring, i + D - PARTS, (i + D - PARTS) % D, off_n,
                     i + D - PARTS < steps, GPS)  # fmt: skip
        cs = i % D
        mbarrier.wait(ready_c.index(cs), (i // D) & 1)
        wv = c_ring.index(cs)._reinterpret(gl.uint32, [BLOCK_N, 8], cw_layout).load(words_layout)
        s1 = _box_rows(gl.expand_dims(s_ring.index(cs).permute((1, 0)).load(box_layout), 1), sel)
        mm = _box_rows(gl.expand_dims(m_ring.index(cs).permute((1, 0)).load(box_layout), 1), sel)
        s1 = gl.convert_layout((s1 & 0xFF).to(gl.uint32), gl.SliceLayout(2, L3))
        mb = gl.convert_layout((mm + 128).to(gl.uint32) * 0x01010101, gl.SliceLayout(2, L3))
        wv4 = gl.expand_dims(gl.expand_dims(wv, 1), 1)
        lv = (((wv4 >> shift) & 0x03030303) * gl.expand_dims(gl.expand_dims(s1, 2), 3)
              + gl.expand_dims(gl.expand_dims(mb, 2), 3)) ^ 0x80808080  # fmt: skip
        lv = gl.reshape(lv, [BLOCK_N, BLOCK_K // 4])
        s = i % NS
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)  # the consumer has released the slot (free at first)
        mbarrier.expect(ready_a.index(s), xq_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(xq_desc, [off_m, i * BLOCK_K], ready_a.index(s), a_ring.index(s))
        if PROBE != 1:
            b_ring.index(s).store(lv)
        fence_async_shared()  # the stored levels visible to the async proxy (the consumer's wgmma)
        mbarrier.arrive(ready_b.index(s))


@gluon.jit
def _ws_levels_even(b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc, s_desc,
                    m_desc, steps, off_m, off_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
                    GPS: gl.constexpr, D: gl.constexpr, PW: gl.constexpr, PROBE: gl.constexpr, PARTS: gl.constexpr):  # fmt: skip
    """The producer of steps 0, PARTS, 2 PARTS, ..."""
    _ws_levels(b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc, s_desc, m_desc,
               steps, off_m, off_n, BLOCK_M, BLOCK_N, NS, GPS, D, PW, PROBE, 0, PARTS)  # fmt: skip


@gluon.jit
def _ws_levels_odd(b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc, s_desc,
                   m_desc, steps, off_m, off_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
                   GPS: gl.constexpr, D: gl.constexpr, PW: gl.constexpr, PROBE: gl.constexpr, PARTS: gl.constexpr):  # fmt: skip
    """The producer of steps 1, 1 + PARTS, ... (PARTS = 2)."""
    _ws_levels(b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc, s_desc, m_desc,
               steps, off_m, off_n, BLOCK_M, BLOCK_N, NS, GPS, D, PW, PROBE, 1, PARTS)  # fmt: skip


@gluon.jit
def _ws_mma(a_ring, b_ring, ready_a, ready_b, empty, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, steps, off_m, off_n,
            HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
            num_warps: gl.constexpr, PROBE: gl.constexpr):  # fmt: skip
    """Consumer partition (the kernel's warps): per K step, wait for the slot, the wgmma issued asynchronously, the
    previous step's slot released once its wgmma has retired; then the epilogue."""
    b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.int8)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, _instr_n(BLOCK_N), 32])  # fmt: skip
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=mma_layout)
    for i in range(steps):
        s = i % NS
        ph = (i // NS) & 1
        mbarrier.wait(ready_a.index(s), ph)
        mbarrier.wait(ready_b.index(s), ph)
        b = b_ring.index(s)._reinterpret(gl.int8, [BLOCK_N, 128], b_smem)
        if PROBE != 2:
            acc = warpgroup_mma(a_ring.index(s), b.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((i + NS - 1) % NS), pred=i > 0)  # step i - 1's wgmma has retired
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
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


@gluon.jit
def _overlap_ws_kernel(xq_desc, w_desc, s_desc, m_desc, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp,
                       HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                       NS: gl.constexpr, GPS: gl.constexpr, D: gl.constexpr, PW: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, PROBE: gl.constexpr = 0,
                       PARTS: gl.constexpr = 1):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y (grouped order), warp-specialized: a 4-warp producer fills an NS-slot ring
    with the token codes (TMA) and the weight's levels, the kernel's warps consume it with wgmma."""
    BLOCK_K: gl.constexpr = 128
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = gl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % width) % gsz) * BLOCK_M
    off_n = ((pid % width) // gsz) * BLOCK_N
    w_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K // 4], gl.uint32)
    a_ring = gl.allocate_shared_memory(gl.int8, [NS, BLOCK_M, BLOCK_K], xq_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.uint32, [NS, BLOCK_N, BLOCK_K // 4], w_smem)
    ready_a = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    c_ring = gl.allocate_shared_memory(gl.uint8, [D, BLOCK_N, 32], w_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.int8, [D, 8, BLOCK_N], s_desc.layout)
    m_ring = gl.allocate_shared_memory(gl.int8, [D, 8, BLOCK_N], m_desc.layout)
    ready_c = gl.allocate_shared_memory(gl.int64, [D, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready_a.index(s), count=1)
        mbarrier.init(ready_b.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(D):
        mbarrier.init(ready_c.index(s), count=1)
    steps = Kp // BLOCK_K
    if PARTS == 2:
        gl.warp_specialize([
            (_ws_mma, (a_ring, b_ring, ready_a, ready_b, empty, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, steps, off_m, off_n,
                       HAS_BIAS, BLOCK_M, BLOCK_N, NS, num_warps, PROBE)),
            (_ws_levels_even, (b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc,
                               s_desc, m_desc, steps, off_m, off_n, BLOCK_M, BLOCK_N, NS, GPS, D, PW, PROBE, PARTS)),
            (_ws_levels_odd, (b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc,
                              s_desc, m_desc, steps, off_m, off_n, BLOCK_M, BLOCK_N, NS, GPS, D, PW, PROBE, PARTS)),
        ], [PW, PW], [PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_ws_mma, (a_ring, b_ring, ready_a, ready_b, empty, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, steps, off_m, off_n,
                       HAS_BIAS, BLOCK_M, BLOCK_N, NS, num_warps, PROBE)),
            (_ws_levels_even, (b_ring, ready_a, ready_b, empty, a_ring, c_ring, s_ring, m_ring, ready_c, xq_desc, w_desc,
                               s_desc, m_desc, steps, off_m, off_n, BLOCK_M, BLOCK_N, NS, GPS, D, PW, PROBE, PARTS)),
        ], [PW], [PRODUCER_REGS])  # fmt: skip


@gluon.jit
def _rs_loader(a_ring, ready, empty, xq_desc, steps, off_m, NS: gl.constexpr):
    """Loader partition (1 warp): step i's token codes, four [BLOCK_M, 32] boxes (one per bit-plane's 32 k), by TMA into
    ring slot ``i % NS`` once the consumer has released it."""
    for i in range(steps):
        s = i % NS
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)  # released by the consumer (free at first)
        mbarrier.expect(ready.index(s), 4 * xq_desc.block_type.nbytes)
        for q in gl.static_range(4):
            tma.async_copy_global_to_shared(xq_desc, [off_m, i * 128 + 32 * q], ready.index(s), a_ring.index(4 * s + q))


@gluon.jit
def _rs_codes(w_rows, s_ptr, m_ptr, rn, c, N, NG, G: gl.constexpr):
    """Chunk ``c``'s code bytes ``[BLOCK_N, 32]`` (in the wgmma A-operand layout of ``w_rows``) and per bit-plane its
    group's ``s1`` and ``m + 128`` per row (uint8 ``[BLOCK_N]``; past K, in the padded chunk: the last group)."""
    cw = gl.load(w_rows + c * 32)
    g0 = gl.minimum((c * 128) // G, NG - 1)
    g1 = gl.minimum((c * 128 + 32) // G, NG - 1)
    g2 = gl.minimum((c * 128 + 64) // G, NG - 1)
    g3 = gl.minimum((c * 128 + 96) // G, NG - 1)
    s0_ = gl.load(s_ptr + g0 * N + rn).to(gl.uint8, bitcast=True)
    s1_ = gl.load(s_ptr + g1 * N + rn).to(gl.uint8, bitcast=True)
    s2_ = gl.load(s_ptr + g2 * N + rn).to(gl.uint8, bitcast=True)
    s3_ = gl.load(s_ptr + g3 * N + rn).to(gl.uint8, bitcast=True)
    m0 = (gl.load(m_ptr + g0 * N + rn).to(gl.int32) + 128).to(gl.uint8)
    m1 = (gl.load(m_ptr + g1 * N + rn).to(gl.int32) + 128).to(gl.uint8)
    m2 = (gl.load(m_ptr + g2 * N + rn).to(gl.int32) + 128).to(gl.uint8)
    m3 = (gl.load(m_ptr + g3 * N + rn).to(gl.int32) + 128).to(gl.uint8)
    return cw, s0_, s1_, s2_, s3_, m0, m1, m2, m3


@gluon.jit
def _rs_plane(cw, s1, mb, ASM: gl.constexpr):
    """Bit-plane q's int8 levels ``[BLOCK_N, 32]`` from the code bytes (four codes a register: ``ASM``, the PTX of
    :func:`~.progressive.levels_asm`)."""
    zero = gl.zeros_like(cw)
    return gl.inline_asm_elementwise(ASM, "=r,r,r,r", [cw, s1[:, None] + zero, mb[:, None] + zero], dtype=gl.int8,
                                     is_pure=True, pack=4)  # fmt: skip


@gluon.jit
def _rs_mma(a_ring, ready, empty, w_ptr, s_ptr, m_ptr, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, KB, NG, steps, off_m, off_n,
            G: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
            ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr, ASM3: gl.constexpr,
            num_warps: gl.constexpr):  # fmt: skip
    """Consumer (the kernel's warps): per K step the weight's levels formed in registers as the wgmma's A operand (one
    k32 wgmma per bit-plane, weights as M, tokens as N, the token codes from the ring), issued asynchronously; the next
    step's levels are formed while they run; the step before's slot released once its wgmmas have retired."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, _instr_n(BLOCK_M), 32])  # fmt: skip
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    rn = gl.minimum(off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout)), N - 1)
    jj = gl.arange(0, 32, layout=gl.SliceLayout(0, a_layout))
    w_rows = w_ptr + rn.to(gl.int64)[:, None] * KB + jj[None, :]
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout=mma_layout)
    cw, s0_, s1_, s2_, s3_, m0, m1, m2, m3 = _rs_codes(w_rows, s_ptr, m_ptr, rn, 0, N, NG, G)
    n = _rs_codes(w_rows, s_ptr, m_ptr, rn, gl.minimum(1, steps - 1), N, NG, G)
    l0 = _rs_plane(cw, s0_, m0, ASM0)
    l1 = _rs_plane(cw, s1_, m1, ASM1)
    l2 = _rs_plane(cw, s2_, m2, ASM2)
    l3 = _rs_plane(cw, s3_, m3, ASM3)
    for i in range(steps):
        s = i % NS
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        acc = warpgroup_mma(l0, a_ring.index(4 * s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(l1, a_ring.index(4 * s + 1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(l2, a_ring.index(4 * s + 2).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(l3, a_ring.index(4 * s + 3).permute((1, 0)), acc, is_async=True)
        # the next step's levels formed (and the one after's codes loaded) while these run
        nn = _rs_codes(w_rows, s_ptr, m_ptr, rn, gl.minimum(i + 2, steps - 1), N, NG, G)
        cw, s0_, s1_, s2_, s3_, m0, m1, m2, m3 = n
        k0 = _rs_plane(cw, s0_, m0, ASM0)
        k1 = _rs_plane(cw, s1_, m1, ASM1)
        k2 = _rs_plane(cw, s2_, m2, ASM2)
        k3 = _rs_plane(cw, s3_, m3, ASM3)
        n = nn
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(s))
        l0, l1, l2, l3 = k0, k1, k2, k3
    # y[token, row] = acc[row, token] * sx[token] * s0[row] (+ bias[row]): expand's order of the two products
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    toks = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    rmask = rows < N
    tmask = toks < M
    sx = gl.load(sx_ptr + toks, mask=tmask, other=0.0)
    s0 = gl.load(s0_ptr + rows, mask=rmask, other=0.0)
    out = acc.to(gl.float32) * sx[None, :] * s0[:, None]
    if HAS_BIAS:
        out += gl.load(b_ptr + rows, mask=rmask, other=0.0).to(gl.float32)[:, None]
    offs = toks.to(gl.int64)[None, :] * N + rows[:, None]
    gl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])


@gluon.jit
def _overlap_rs_kernel(xq_desc, w_ptr, s_ptr, m_ptr, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp, KB, NG,
                       G: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       GROUP_M: gl.constexpr, NS: gl.constexpr, ASM0: gl.constexpr, ASM1: gl.constexpr,
                       ASM2: gl.constexpr, ASM3: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y (grouped order): a 1-warp TMA loader of the token codes, the kernel's warps
    forming the levels in registers and issuing the wgmmas."""
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = gl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % width) % gsz) * BLOCK_M
    off_n = ((pid % width) // gsz) * BLOCK_N
    a_ring = gl.allocate_shared_memory(gl.int8, [4 * NS, BLOCK_M, 32], xq_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    steps = Kp // 128
    gl.warp_specialize([
        (_rs_mma, (a_ring, ready, empty, w_ptr, s_ptr, m_ptr, sx_ptr, s0_ptr, b_ptr, y_ptr, M, N, KB, NG, steps, off_m,
                   off_n, G, HAS_BIAS, BLOCK_M, BLOCK_N, NS, ASM0, ASM1, ASM2, ASM3, num_warps)),
        (_rs_loader, (a_ring, ready, empty, xq_desc, steps, off_m, NS)),
    ], [1], [48])  # fmt: skip


def _launch_rs(xq: torch.Tensor, sx: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor,
               cfg: dict) -> None:  # fmt: skip
    """The register-operand kernel (``RS=1``) on the activation codes ``xq [M, Kp]``."""
    M, Kp = xq.shape
    N = weight.out_features
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    xq_desc = TensorDescriptor.from_tensor(xq, [bm, 32], gl.NVMMASharedLayout.get_default_for([bm, 32], gl.int8))
    asm = [levels_asm(2, q) for q in range(4)]
    _overlap_rs_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        xq_desc, weight.qweight, weight.scales, weight.zeros, sx, weight.supers.reshape(-1),
        weight.supers if bias is None else bias, y, M, N, Kp, weight.qweight.shape[1], weight.scales.shape[0],
        G=weight.group_size, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8),
        NS=cfg["num_stages"], ASM0=asm[0], ASM1=asm[1], ASM2=asm[2], ASM3=asm[3], num_warps=cfg["num_warps"],
        maxnreg=cfg.get("MAXNREG", 168),
    )  # fmt: skip


def _launch_ws(xq: torch.Tensor, sx: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor,
               cfg: dict) -> None:  # fmt: skip
    """The warp-specialized kernel (``WS=1``) on the activation codes ``xq [M, Kp]``."""
    M, Kp = xq.shape
    N, G = weight.out_features, weight.group_size
    bm, bn, gps = cfg["BLOCK_M"], cfg["BLOCK_N"], 128 // G
    desc = lambda t, block, dt: TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))  # noqa: E731
    _overlap_ws_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        desc(xq, [bm, 128], gl.int8), desc(weight.qweight, [bn, 32], gl.uint8), desc(weight.scales, [8, bn], gl.int8),
        desc(weight.zeros, [8, bn], gl.int8), sx, weight.supers.reshape(-1), weight.supers if bias is None else bias,
        y, M, N, Kp, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8),
        NS=cfg["num_stages"], GPS=gps, D=cfg.get("D", 4), PW=cfg.get("PW", 4), PRODUCER_REGS=cfg.get("PRODUCER_REGS", 96),
        num_warps=cfg["num_warps"], maxnreg=cfg.get("MAXNREG", 168), PROBE=cfg.get("PROBE", 0), PARTS=cfg.get("PARTS", 1),
    )  # fmt: skip


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass, then the kernel for ``x2 [M, K]``, writing ``y [M, N]``."""
    check(x2, weight, cfg)
    M, N = x2.shape[0], weight.out_features
    Kp = weight.qweight.shape[1] * 4
    xq, sx, _ = quantize_rows(x2, Kp, sums=False, act_amax=act_amax)
    if cfg.get("RS"):
        return _launch_rs(xq, sx, weight, bias, y, cfg)
    if cfg.get("WS"):
        return _launch_ws(xq, sx, weight, bias, y, cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _overlap_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        xq, sx, weight.qweight, weight.scales, weight.zeros, weight.supers.reshape(-1),
        weight.supers if bias is None else bias, y, M, N, Kp, weight.qweight.shape[1], weight.scales.shape[0],
        G=weight.group_size, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8),
        STAGES=cfg["num_stages"], num_warps=cfg["num_warps"], **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {}),
    )  # fmt: skip
