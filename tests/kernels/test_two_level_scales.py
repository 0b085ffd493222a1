"""The two-level scale form (int8 sub-block scales and mins times float32 super-block scales: GGUF's
K-quants as the file stores them, and the per-channel float times integer group scales of the GPU
prefill issue): through the general op and the planned op on every ISA of this CPU, bit-identical to the
same weight with the products stored as float32 scales (what ``aipc_native.h`` promises), within the
W*A8 tests' tolerance of the kernels' exact math in float64; the packed layouts round-trip; a row reads
fewer bytes; bad operands are refused naming the operand."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing, planned_ops
from aipc_kernels.lowbit.formats import LowBitWeight, get_codebook, pack_codes
from aipc_kernels.lowbit.contract import check_operands

#: fixed-zero and min-form code books (the two-level form takes no stored zero points)
CODEBOOKS = ["int2", "ternary", "sym", "binary", "int4", "int6", "int8", "min2", "min4", "min8"]
#: (M, N, K, group, super-block, act_group): decode, a 3-super-block row, AMX tiles with per-group
#: activations, one super-block per row (a per-channel float scale), sub-blocks of 16 with act groups of 64, and
#: sub-blocks of 16 on AMX's tiles (from 32 tokens) with and without per-group activations, and on AVX-512's
#: up-converted tiles (6-bit codes from 80 tokens; 2- and 4-bit from 512: GGUF's K-quants in a prompt)
CASES = [(1, 37, 512, 32, 256, 0), (5, 16, 768, 32, 256, 0), (20, 33, 512, 32, 256, 32), (1, 50, 1024, 64, 1024, 0),
         (17, 20, 256, 16, 64, 64), (3, 18, 4096, 64, 2048, 0), (33, 21, 256, 16, 64, 64), (40, 24, 512, 16, 256, 0),
         (83, 19, 256, 16, 64, 32), (81, 17, 512, 16, 256, 0), (515, 17, 512, 32, 256, 32),
         (513, 18, 256, 32, 256, 0)]  # fmt: skip


def two_level_weight(codebook: str, N: int, K: int, G: int, SB: int, seed: int) -> LowBitWeight:
    """Random codes, int8 sub-block scales over the whole int8 range (min form: mins in [0, 63], as GGUF's
    ``mn``, under negative super-block scales, as its ``-dmin``) and fp16-valued float32 super-block scales
    (one zero, as a padded row's)."""
    if get_codebook(codebook).bits == 1:
        G = max(G, 32)  # 1-bit codes take groups of 32 and more
    g = torch.Generator().manual_seed(seed)
    cb = get_codebook(codebook)
    codes = torch.randint(0, cb.max_code + 1, (N, K), generator=g, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (N, K // G), generator=g).to(torch.int8)

    def fp16_scales():
        d = (torch.rand(N, K // SB, generator=g) * 2e-3 + 1e-5).half().float()
        d[0, 0] = 0.0
        return d

    supers, mins = [fp16_scales()], None
    if cb.mins:
        mins = torch.randint(0, 64, (N, K // G), generator=g).to(torch.int8)
        supers.append(-fp16_scales())
    return LowBitWeight(pack_codes(codes, cb.bits), sub, mins, codebook, G, K, supers=torch.stack(supers))


def _planned(p: packing.PackedLowBit, act_group: int) -> Optional[torch.Tensor]:
    call = planned_ops.plan_cpu_call(p, act_group)
    return None if call is None else (lambda x, bias: call(x, p.qweight, p.scales, p.zeros, bias, None, p.supers))


@pytest.mark.skipif(not native.available(), reason="native library not built")
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("M, N, K, G, SB, act_group", CASES)
def test_op_equals_float32_scales_bit_for_bit(isa, codebook, M, N, K, G, SB, act_group):
    w = two_level_weight(codebook, N, K, G, SB, seed=M * 31 + N + K)
    act_group = act_group if act_group % w.group_size == 0 else 0
    one = w.single_level()
    assert one.scales.dtype == torch.float32 and one.supers is None
    p, q = packing.pack_for_cpu(w), packing.pack_for_cpu(one)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    bias = torch.randn(N)
    y = ops.lowbit_linear(x, p, bias, act_group=act_group)
    assert torch.equal(y, ops.lowbit_linear(x, q, bias, act_group=act_group))
    native.set_isa("scalar")  # and the portable kernel's bits (the isa fixture restores the best ISA after)
    assert torch.equal(y, ops.lowbit_linear(x, p, bias, act_group=act_group))
    native.set_isa(isa)
    ref = ops.reference_linear_w8(x, w, bias, act_group=act_group)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    planned = _planned(p, act_group)
    if planned is not None:
        assert torch.equal(planned(x, bias), y)


@pytest.mark.skipif(not native.available(), reason="native library not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_and_the_reference_path(dtype):
    w = two_level_weight("min4", 40, 512, 32, 256, seed=3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = ops.lowbit_linear(x, packing.pack_for_cpu(w))
    assert y.dtype == dtype and torch.equal(y, ops.lowbit_linear(x, packing.pack_for_cpu(w.single_level())))
    canonical = packing.as_canonical_packed(w)  # the weight-only reference: dequantize, float32 matmul
    assert torch.equal(ops.lowbit_linear(x, canonical), ops.reference_linear(x, w.single_level()))


@pytest.mark.parametrize("codebook", ["int8", "min4", "min2"])
def test_values_layouts_and_bytes(codebook):
    w = two_level_weight(codebook, 21, 768, 16 if codebook != "min4" else 32, 256, seed=9)
    one = w.single_level()
    a, b = w.dequantize(), one.dequantize()
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    p = packing.pack_for_cpu(w)
    assert p.scales.dtype == torch.int8 and p.supers.shape == (1 + w.cb.mins, 2, 3, 16)
    back = packing.to_canonical(p)
    assert torch.equal(back.scales, w.scales) and torch.equal(back.supers, w.supers)
    rows = torch.tensor([20, 0, 7, 7])
    assert torch.equal(packing.dequantize_rows(p, rows), a[rows])
    assert torch.equal(packing.dequantize_rows(packing.as_canonical_packed(w), rows), a[rows])
    t = packing.pack_for_triton(w)  # single-level scales: the products
    assert t.supers is None and t.scales.dtype == torch.float32 and torch.equal(packing.to_canonical(t).dequantize(), a)
    # a row reads 1 byte per group for its scale (2 with mins) and 4 (8) per super-block, not 4 (8) per group
    codes, groups, supers = w.qweight.numel(), w.scales.numel(), w.supers.numel()
    per = 2 if w.cb.mins else 1
    assert w.nbytes() == codes + per * groups + 4 * supers and one.nbytes() == codes + 4 * per * groups
    state = w.state_dict("layer")
    assert set(state) == {"layer.qweight", "layer.scales", "layer.supers"} | ({"layer.zeros"} if w.cb.mins else set())
    again = LowBitWeight.from_state_dict(state, "layer", codebook, w.group_size, 768)
    assert torch.equal(again.dequantize().view(torch.int32), a.view(torch.int32))


def test_save_and_load_keep_the_two_levels(tmp_path):
    from aipc_kernels.lowbit.formats import load_lowbit, save_lowbit

    w = two_level_weight("min4", 16, 512, 32, 256, seed=4)
    path = tmp_path / "w.safetensors"
    flat = w.single_level()
    save_lowbit(str(path), {"layer": w, "flat": replace(flat, qweight=flat.qweight.clone())})
    got, extra = load_lowbit(str(path))
    assert not extra and got["layer"].supers is not None and got["flat"].supers is None
    assert torch.equal(got["layer"].dequantize(), w.dequantize())


def test_bad_operands_are_refused_naming_them():
    w = two_level_weight("min4", 16, 512, 32, 256, seed=5)
    p = packing.pack_for_cpu(w)
    x = torch.randn(1, 512)
    args = (None, "cpu_vnni16", "min4", 32, 16, 0)
    with pytest.raises(ValueError, match=r"int8 scales .* and float32 supers"):
        check_operands(x, p.qweight, p.scales, p.zeros, *args)  # int8 scales without supers
    one = packing.pack_for_cpu(w.single_level())
    with pytest.raises(ValueError, match=r"int8 scales .* and float32 supers"):
        check_operands(x, one.qweight, one.scales, one.zeros, *args, supers=p.supers)  # float scales with supers
    with pytest.raises(ValueError, match=r"supers of shape \(1, 1, 2, 16\)"):
        check_operands(x, p.qweight, p.scales, p.zeros, *args, supers=p.supers[:1])  # the mins' half missing
    with pytest.raises(ValueError, match=r"supers of shape .* power-of-two multiple of group_size=32"):
        three = torch.zeros(2, 1, 6, 16)  # 512 / 6 is no super-block
        check_operands(x, p.qweight, p.scales, p.zeros, *args, supers=three)
    with pytest.raises(ValueError, match=r"codebook 'affine4' stores zero points; the two-level form"):
        LowBitWeight(w.qweight, w.scales, w.zeros, "affine4", 32, 512, supers=w.supers[:1])
    with pytest.raises(ValueError, match=r"w\.supers has shape \(2, 16, 3\)"):
        LowBitWeight(w.qweight, w.scales, w.zeros, "min4", 32, 512, name="w", supers=torch.zeros(2, 16, 3))
    with pytest.raises(ValueError, match=r"int8"):
        LowBitWeight(w.qweight, w.scales.float(), w.zeros.float(), "min4", 32, 512, supers=w.supers)
    if native.available():  # the C entry refuses too (the checks above run first in every op)
        y = torch.empty(1, 16)
        with pytest.raises(RuntimeError, match=r"two-level scales"):
            native.lowbit_linear_into(y, x, p.qweight, p.scales, p.zeros, None, 4, 32, 1.0, 0.0, 512)
