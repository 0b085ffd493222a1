"""Batch invariance of the native low-bit kernels: a row's output bits do not depend on how many rows
are computed with it (decode kernel, token tiles of every width, up-converted tiles, AMX tiles and
passes), on the thread count or on the instruction set, because every kernel computes the same
integer group dots and the same per-group float epilogue in the same order (csrc/lowbit_kernels.h)."""
import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing
from aipc_kernels.lowbit.formats import CODEBOOKS
from aipc_kernels.lowbit.quantizers import quantize_rtn

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

ISAS = native.supported_isas() if native.available() else []
# batch sizes that reach every kernel and remainder: decode (1), on-the-fly tiles below up_min_m (otf_m: tiles of 8
# with every remainder 1-8, 1-bit codes tiles of 2), up-converted tiles of 8 with a remainder (1-bit codes from 8
# tokens on: 8-257; 6-bit from 80: 81, 257, 513; 2- and 4-bit from 512: 513; 8-bit never), AMX tiles of 16 with
# padding (16, 17, 33) and further AMX passes (AMX_MB = 256 tokens: 257, 513)
BATCHES = (2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 23, 33, 81, 257, 513)


def _rows_alone_and_in_batches(x: torch.Tensor, p, bias, act_group: int) -> list[tuple[str, torch.Tensor]]:
    """The first rows of ``x`` computed as one batch of each size, and each row alone (M = 1)."""
    alone = torch.cat([ops.lowbit_linear(x[i : i + 1], p, bias, act_group) for i in range(4)])
    outs = [("alone", alone)]
    for M in BATCHES:
        outs.append((f"M={M}", ops.lowbit_linear(x[:M], p, bias, act_group)[:4]))
    return outs


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group, act_group", [(64, 0), (32, 128), (-1, 0)], ids=["g64", "g32-act128", "row"])
def test_row_bits_independent_of_batch_threads_and_isa(codebook, dtype, group, act_group):
    N, K = 45, 256  # a partial last row block
    g = torch.Generator().manual_seed(sorted(CODEBOOKS).index(codebook) * 1000 + group + act_group)  # reproducible
    w = quantize_rtn(torch.randn(N, K, generator=g), codebook, group, scale_dtype=torch.bfloat16)
    p = packing.pack_for_cpu(w)
    x = torch.randn(max(BATCHES), K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for isa in ISAS:
            native.set_isa(isa)
            for t in sorted({1, 2, threads}):
                torch.set_num_threads(t)
                results += [(f"{isa} threads={t} {name}", y) for name, y in _rows_alone_and_in_batches(x, p, bias, act_group)]
    finally:
        native.set_isa(native.best_isa())
        torch.set_num_threads(threads)
    base_name, base = results[0]
    # the bits are right, not only the same: float64 exact math of the kernel within float32 rounding
    exact = ops.reference_linear_w8(x[:4], w, bias, act_group)
    tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(base.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for name, y in results[1:]:
        differ = (y.view(bits) != base[: len(y)].view(bits)).sum().item()
        assert differ == 0, f"{name}: {differ} of {y.numel()} outputs differ in bits from {base_name}"


@pytest.mark.parametrize("codebook, M", [("int4", 513), ("int6", 81), ("int8", 40), ("min4", 513), ("min6", 81)])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act_group", [0, 32])
def test_up_converted_tiles_per_scale_type_match_the_portable_kernel(codebook, M, scale_dtype, act_group):
    """Each scale type of the fixed-zero code books and of the min form (``min4`` / ``min6``: a min per group, as
    GGUF's Q4_1 / Q5_1), with and without activation group scales, on the up-converted tiles (4-bit codes from 512
    tokens, 6-bit from 80; 8-bit never up-converts): the rows' bits on every ISA are the portable kernel's, and
    within float32 rounding of the kernels' exact math."""
    N, K = 37, 256
    g = torch.Generator().manual_seed(M + act_group)
    w = quantize_rtn(torch.randn(N, K, generator=g), codebook, 32, scale_dtype=scale_dtype)
    p = packing.pack_for_cpu(w)
    x = torch.randn(M, K, generator=g)
    try:
        native.set_isa("scalar")
        want = ops.lowbit_linear(x, p, None, act_group)
        for isa in ISAS:
            native.set_isa(isa)
            y = ops.lowbit_linear(x, p, None, act_group)
            differ = (y.view(torch.int32) != want.view(torch.int32)).sum().item()
            assert differ == 0, f"{isa}: {differ} of {y.numel()} outputs differ in bits from the portable kernel's"
    finally:
        native.set_isa(native.best_isa())
    exact = ops.reference_linear_w8(x, w, None, act_group)
    torch.testing.assert_close(want.double(), exact, rtol=2e-5, atol=2e-5 * exact.abs().max().item())
