"""The planned CPU ops (aipc::lowbit_linear_cpu / lowbit_linear_a16_cpu, C++ against PyTorch's stable ABI):
bit-identical to the general ops (which test_lowbit_linear / test_lowbit_a16 hold to float64 references) on
every ISA, against a float64 reference directly, under torch.compile, and every per-call check refusing
with the operand named."""
from __future__ import annotations

import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing, planned_ops
from aipc_kernels.lowbit.formats import CODEBOOKS
from aipc_kernels.lowbit.quantizers import quantize_rtn

pytestmark = pytest.mark.skipif(not planned_ops.available(), reason="planned CPU ops not built")


def _packed(codebook: str, N: int, K: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(N, K, generator=g), codebook, group)
    return w, packing.pack_for_cpu(w)


def _planned(p, *args, **kw):
    call = planned_ops.plan_cpu_call(p, *args, **kw)
    assert call is not None
    return lambda x, bias=None, act_amax=None: call(x, p.qweight, p.scales, p.zeros, bias, act_amax)


def test_the_cpu_kernels_are_the_cpp_unit():
    """The schemas' CPU kernels come from csrc/ops (no Python kernel is registered for them)."""
    assert native.ops_library() is not None
    for name in ("aipc::lowbit_linear_cpu", "aipc::lowbit_linear_a16_cpu"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
        cpu = next(line for line in torch._C._dispatch_dump(name).splitlines() if line.startswith("CPU:"))
        assert "csrc/ops/lowbit_ops.cpp" in cpu, cpu


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("M, N, K, group, act_group", [
    (1, 37, 256, 32, 0), (3, 16, 128, 64, 64), (13, 33, 192, -1, 0), (40, 17, 256, 64, 128), (1, 129, 576, 64, 0),
])  # fmt: skip
def test_equals_the_general_op(isa, codebook, M, N, K, group, act_group):
    w, p = _packed(codebook, N, K, group, seed=M * 7 + N)
    x, bias = torch.randn(M, K), torch.randn(N)
    y = _planned(p, act_group)(x, bias)
    assert torch.equal(y, ops.lowbit_linear(x, p, bias, act_group=act_group))
    ref = ops.reference_linear_w8(x, w, bias, act_group=act_group)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_leading_dims_strides_bias_and_amax(isa, dtype):
    _, p = _packed("affine", 70, 512, 64, seed=5)
    planned = _planned(p)
    x = torch.randn(2, 5, 1024).to(dtype)[..., ::2]  # strided: the op makes it dense
    bias = torch.randn(70)  # float32 with lower-precision x: converted like the general op
    y = planned(x, bias)
    assert y.shape == (2, 5, 70) and y.dtype == dtype
    assert torch.equal(y, ops.lowbit_linear(x, p, bias))
    amax = x.float().abs().amax(-1).reshape(-1) * 1.5  # a tensor-parallel row's absmax
    assert torch.equal(planned(x, bias, amax), ops.lowbit_linear(x, p, bias, act_amax=amax))
    assert planned(x[:, :0], bias).shape == (2, 0, 70)  # no token


@pytest.mark.parametrize("codebook", sorted(n for n, c in CODEBOOKS.items() if c.bits == 4 and not c.mins))
@pytest.mark.parametrize("dequant", ["e0m4", "int"])
def test_a16_equals_the_general_op(isa, codebook, dequant):
    _, p = _packed(codebook, 45, 384, 128, seed=9)
    for M, dtype in ((1, torch.float32), (6, torch.bfloat16)):
        x, bias = torch.randn(M, 384).to(dtype), torch.randn(45).to(dtype)
        y = _planned(p, dequant=dequant)(x, bias)
        assert torch.equal(y, ops.lowbit_linear_a16(x, p, bias, dequant))


def test_compiles_fullgraph():
    _, p = _packed("int2", 40, 256, 64, seed=3)
    _, p4 = _packed("int4", 40, 256, 64, seed=4)
    w8, a16 = _planned(p), _planned(p4, dequant="e0m4")
    fn = torch.compile(lambda x: a16(w8(x) @ torch.ones(40, 256) / 40), fullgraph=True)
    x = torch.randn(3, 256)
    assert torch.equal(fn(x), a16(w8(x) @ torch.ones(40, 256) / 40))


def test_per_call_checks_name_the_operand():
    _, p = _packed("int4", 37, 256, 64, seed=1)
    planned = _planned(p)
    with pytest.raises(RuntimeError, match=r"x has K=128 features but the weight holds 256 per row"):
        planned(torch.randn(1, 128))
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        planned(torch.randn(1, 256, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"act_amax must be float32 with one value per token \(M=2\)"):
        planned(torch.randn(2, 256), None, torch.ones(3))
    with pytest.raises(RuntimeError, match="bias has 36 values; expected out_features=37"):
        planned(torch.randn(1, 256), torch.randn(36))
    call = planned_ops.plan_cpu_call(p)
    with pytest.raises(RuntimeError, match="qweight must be a dense CPU tensor"):
        call(torch.randn(1, 256), p.qweight.transpose(0, 1), p.scales, p.zeros)


def test_plan_refuses_bad_operands_and_other_layouts():
    w, p = _packed("int4", 37, 256, 64, seed=2)
    with pytest.raises(ValueError, match="act_group=48"):
        planned_ops.plan_cpu_call(p, act_group=48)
    with pytest.raises(ValueError, match="codebook='int2' has 2-bit codes"):
        planned_ops.plan_cpu_call(packing.pack_for_cpu(quantize_rtn(torch.randn(8, 64), "int2", 32)), dequant="e0m4")
    assert planned_ops.plan_cpu_call(packing.pack_for_triton(w)) is None  # the general op's layouts


def test_switched_off_for_an_ab_run(monkeypatch):
    """AIPC_PLANNED_OPS=0: callers get None and run the general op on the same kernels."""
    _, p = _packed("int2", 16, 64, 32, seed=6)
    monkeypatch.setenv("AIPC_PLANNED_OPS", "0")
    assert planned_ops.plan_cpu_call(p) is None
    monkeypatch.setenv("AIPC_PLANNED_OPS", "1")
    assert planned_ops.plan_cpu_call(p) is not None
