"""aipc::rope: transformers' rotary embedding in one pass, bit-identical to its torch ops (float32 / bf16 /
fp16; strided views of a merged q/k/v output; partial rotary; cos shared by the batch; prefill and decode
sizes; NaN and infinities; under every ISA), its errors, and its fake kernel under torch.compile."""
import pytest
import torch

from aipc_kernels.decoder.rope import apply_rope, native_rope, rope_reference

pytestmark = pytest.mark.skipif(not native_rope(), reason="native ops not built")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def operands(B, L, H, D, R, dt, seed, extra=24, shared_cos=False):
    """x as a view into a wider [B, L, H*D + extra] tensor (as q/k inside a merged qkv), cos / sin in dt."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(B, L, H * D + extra, generator=g)).to(dt)
    x = qkv[..., : H * D].view(B, L, H, D)
    theta = torch.rand(1 if shared_cos else B, L, R // 2, generator=g) * 40
    ang = torch.cat([theta, theta], dim=-1)
    return x, ang.cos().to(dt), ang.sin().to(dt)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("B,L,H,D,R", [(4, 1, 16, 64, 64), (1, 300, 24, 64, 64), (2, 7, 5, 96, 32), (3, 5, 3, 128, 128),
                                       (1, 1, 1, 2, 2), (5, 2, 7, 80, 80), (2, 129, 9, 64, 48)])
def test_bit_identical_to_transformers_ops(dt, B, L, H, D, R, isa):
    """Under every ISA the CPU has: each compiles the row loops for its own vectors (the dispatch table)."""
    x, cos, sin = operands(B, L, H, D, R, dt, seed=B * 1000 + L * 10 + H)
    got = torch.ops.aipc.rope(x, cos, sin)
    assert got.is_contiguous() and got.shape == x.shape and got.dtype == dt
    assert torch.equal(got, rope_reference(x, cos, sin))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_cos_shared_by_the_batch_and_contiguous_x(dt):
    x, cos, sin = operands(3, 17, 4, 64, 64, dt, seed=3, shared_cos=True)
    assert torch.equal(torch.ops.aipc.rope(x, cos, sin), rope_reference(x, cos, sin))
    xc = x.contiguous()
    assert torch.equal(torch.ops.aipc.rope(xc, cos, sin), rope_reference(xc, cos, sin))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_nan_and_infinities_propagate_as_in_torch(dt, isa):
    x, cos, sin = operands(2, 3, 2, 64, 64, dt, seed=5)
    x = x.clone()
    x[0, 0, 0, 3], x[1, 2, 1, 40], x[0, 1, 1, 0] = float("nan"), float("inf"), -float("inf")
    sin = sin.clone()
    sin[1, 0, 5] = float("nan")
    torch.testing.assert_close(torch.ops.aipc.rope(x, cos, sin), rope_reference(x, cos, sin), rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip


def test_apply_rope_uses_the_op_and_falls_back_for_mixed_dtypes():
    x, cos, sin = operands(2, 4, 3, 64, 64, torch.bfloat16, seed=7)
    assert torch.equal(apply_rope(x, cos, sin), rope_reference(x, cos, sin))
    cos32, sin32 = cos.float(), sin.float()  # the op refuses these; apply_rope runs the torch ops
    assert torch.equal(apply_rope(x, cos32, sin32), rope_reference(x, cos32, sin32))
    x64, c64, s64 = x.double(), cos.double(), sin.double()  # a dtype the kernel does not take
    assert torch.equal(apply_rope(x64, c64, s64), rope_reference(x64, c64, s64))


def test_errors_name_the_operand():
    x, cos, sin = operands(2, 4, 3, 64, 64, torch.float32, seed=9)
    with pytest.raises(RuntimeError, match=r"aipc::rope: x must be \[B, L, heads, head_dim\]"):
        torch.ops.aipc.rope(x[0], cos, sin)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[B or 1, L, rotary_dim\] for x of B=2, L=4"):
        torch.ops.aipc.rope(x, cos[:, :3], sin[:, :3])
    with pytest.raises(RuntimeError, match=r"rotary_dim=66 must be even and at most head_dim=64"):
        torch.ops.aipc.rope(x, torch.ones(2, 4, 66), torch.ones(2, 4, 66))
    with pytest.raises(RuntimeError, match=r"cos and sin must have x's dtype"):
        torch.ops.aipc.rope(x, cos.bfloat16(), sin.bfloat16())


def test_fake_kernel_and_torch_compile():
    x, cos, sin = operands(2, 3, 4, 64, 64, torch.bfloat16, seed=11)
    eager = torch.ops.aipc.rope(x, cos, sin)
    compiled = torch.compile(lambda a, c, s: torch.ops.aipc.rope(a, c, s) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, cos, sin), eager * 2)
