"""packing.dequantize_rows: rows read from a device layout equal the canonical weight's dequantized rows,
bit for bit, in every code book and layout (a GGUF token embedding is looked up this way from the
packed tensor its tied output projection multiplies with)."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aipc_kernels.lowbit import packing
from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight, pack_codes


def random_weight(n: int, k: int, codebook: str, group: int, dtype: torch.dtype, seed: int) -> LowBitWeight:
    g = torch.Generator().manual_seed(seed)
    cb = CODEBOOKS[codebook]
    G = k if group == -1 else group
    codes = torch.randint(0, cb.max_code + 1, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // G, generator=g) + 0.05).to(dtype)
    zeros = None
    if cb.per_group_tensor:
        zeros = torch.randn(n, k // G, generator=g)
        if cb.integer_zero:
            zeros = torch.randint(0, cb.max_code + 1, (n, k // G), generator=g).float()
        zeros = zeros.to(dtype)
    return LowBitWeight(pack_codes(codes, cb.bits), scales, zeros, codebook, G, k)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k=st.sampled_from([32, 64, 128, 256]), codebook=st.sampled_from(sorted(CODEBOOKS)),
       group=st.sampled_from([16, 32, -1]), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_rows_from_every_layout_equal_the_canonical_dequantization(n, k, codebook, group, dtype, seed):
    assume(group != 16 or CODEBOOKS[codebook].bits >= 2)  # the format's rule for groups of 16 (GGUF K-quants)
    w = random_weight(n, k, codebook, group, dtype, seed)
    full = w.dequantize()
    rows = torch.randint(0, n, (7,), generator=torch.Generator().manual_seed(seed))
    for packed in (packing.pack_for_cpu(w), packing.pack_for_triton(w), packing.as_canonical_packed(w)):
        got = packing.dequantize_rows(packed, rows)
        assert got.dtype == torch.float32 and got.shape == (7, k)
        assert torch.equal(got, full[rows]), packed.layout
    assert torch.equal(packing.dequantize_rows(packing.pack_for_cpu(w), rows.view(7, 1), torch.float64),
                       w.dequantize(torch.float64)[rows])  # fmt: skip


def test_unknown_layout_is_named():
    w = random_weight(4, 32, "int8", 32, torch.float16, 0)
    p = packing.as_canonical_packed(w)
    p.layout = "nope"
    with pytest.raises(ValueError, match="layout='nope'"):
        packing.dequantize_rows(p, torch.tensor([0]))
