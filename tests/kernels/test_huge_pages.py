"""core.huge_pages: packed CPU weights copied onto a mapping advised for transparent huge pages (the
values and every op's outputs unchanged), and left alone where that does not apply."""
import gc

import pytest
import torch

import aipc_kernels.lowbit.ops  # noqa: F401  (registers torch.ops.aipc.lowbit_linear)
from aipc_kernels.core import huge_pages
from aipc_kernels.core.huge_pages import HUGE_PAGE, MIN_BYTES, on_huge_pages
from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import pack_for_cpu
from aipc_kernels.lowbit.quantizers import quantize_rtn

needs_thp = pytest.mark.skipif(not huge_pages.enabled(), reason="THP off on this kernel (or not Linux)")


def vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address ``ptr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("extra", [0, 1, 12345])
def test_copy_is_equal_aligned_and_advised(dtype, extra):
    n = (MIN_BYTES + extra * 4) // torch.tensor([], dtype=dtype).element_size()
    t = torch.randn(n).to(dtype) if dtype.is_floating_point else torch.randint(0, 256, (n,), dtype=dtype)
    t = t.view(4, -1) if n % 4 == 0 else t
    h = on_huge_pages(t)
    assert h.dtype == t.dtype and h.shape == t.shape and h.is_contiguous() and torch.equal(h, t)
    assert h.data_ptr() != t.data_ptr() and h.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(h.data_ptr()), "the mapping was not advised MADV_HUGEPAGE"
    before = t.clone()
    h.view(-1)[:99] = 0  # writable, and memory of its own
    assert torch.equal(t, before)


@needs_thp
def test_the_mapping_lives_as_long_as_the_tensor():
    t = torch.arange(MIN_BYTES // 4, dtype=torch.int32)
    h = on_huge_pages(t)[7:]  # a view: nothing else holds the mapping
    gc.collect()
    assert torch.equal(h, t[7:]) and "hg" in vm_flags(h.data_ptr())


def test_left_alone_where_it_does_not_apply(monkeypatch):
    small = torch.randn(MIN_BYTES // 4 - 1)
    assert on_huge_pages(small) is small
    strided = torch.randn(2, MIN_BYTES // 4)[:, ::2]
    assert on_huge_pages(strided) is strided
    big = torch.randn(MIN_BYTES // 4)
    monkeypatch.setenv("AIPC_HUGE_PAGES", "0")
    assert not huge_pages.enabled() and on_huge_pages(big) is big


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("garbage", "never")):  # fmt: skip
        f.write_text(text)
        monkeypatch.setattr(huge_pages, "_THP_ENABLED", f)
        huge_pages.thp_mode.cache_clear()
        assert huge_pages.thp_mode() == mode
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", tmp_path / "absent")
    huge_pages.thp_mode.cache_clear()
    assert huge_pages.thp_mode() == "never"
    huge_pages.thp_mode.cache_clear()


@needs_thp
@pytest.mark.parametrize("codebook,group", [("int4", 128), ("affine", 64), ("int8", -1)])
def test_packed_weight_on_huge_pages_gives_the_same_outputs(codebook, group):
    """pack_for_cpu puts a weight's codes of 2 MiB and more on huge pages; the op's outputs from them are
    bit for bit those from a small-page copy of the same tensors."""
    K = 1056  # a multiple of 32 only; N: whole row blocks past 2 MiB of codes, plus one of 16
    N = (MIN_BYTES * 8 // (get_codebook(codebook).bits * K) // 16 + 1) * 16 + 16
    w = quantize_rtn(torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.02, codebook,
                     group if group == -1 or K % group == 0 else 32)  # fmt: skip
    p = pack_for_cpu(w)
    assert p.qweight.numel() >= MIN_BYTES and "hg" in vm_flags(p.qweight.data_ptr())
    x = torch.randn(5, K, dtype=torch.bfloat16)
    meta = (p.layout, p.codebook, p.group_size, p.out_features)
    small = [None if t is None else t.clone() for t in (p.qweight, p.scales, p.zeros)]
    y_huge = torch.ops.aipc.lowbit_linear(x, p.qweight, p.scales, p.zeros, None, *meta, 0)
    y_small = torch.ops.aipc.lowbit_linear(x, *small, None, *meta, 0)
    assert torch.equal(y_huge, y_small)
