"""bench/harness/step_profile.py: a decode step's profiled ops summed by who owns them (the low-bit op, vLLM's
compiled graph's Python and its C++ kernels, the rest), on op names as the torch profiler records them in a vLLM
decode step (inductor's kernels under ``cpp.enable_kernel_profile``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from harness.step_profile import KERNEL_PROFILE, op_groups, ownership_line, with_kernel_profile  # noqa: E402

# per-step self times and calls of a one-sequence decode step of the 1B lowbit4 model (names as recorded)
OPS = {
    "aipc::lowbit_linear_cpu 16384 x 2048": dict(self_ms=9.29, calls=16),
    "aipc::lowbit_linear_cpu 128256 x 2048": dict(self_ms=7.38, calls=1),
    "## Call CompiledFxGraph None ##": dict(self_ms=2.67, calls=1),
    "graph_0_cpp_fused_lowbit_linear_cpu_mul_silu_slice_3": dict(self_ms=0.15, calls=16),
    "graph_0_cpp_fused__to_copy_add_lowbit_linear_cpu_mean_mul_pow_rsqrt_6": dict(self_ms=0.03, calls=7),
    "vllm::unified_attention_with_output": dict(self_ms=0.78, calls=16),
    "aten::slice": dict(self_ms=0.34, calls=144),
}


def test_op_groups_sum_each_owner():
    g = op_groups(OPS)
    assert g["lowbit"] == pytest.approx(dict(self_ms=16.67, calls=17))
    assert g["compiled_kernels"] == pytest.approx(dict(self_ms=0.18, calls=23))
    assert g["compiled_graph"] == pytest.approx(dict(self_ms=2.67, calls=1))
    assert g["other"] == pytest.approx(dict(self_ms=1.12, calls=160))
    assert sum(v["self_ms"] for v in g.values()) == pytest.approx(sum(v["self_ms"] for v in OPS.values()))


def test_ownership_line_names_the_kernels_or_their_absence():
    line = ownership_line(dict(ops=OPS, step_ms=25.0), "the step")
    assert "the low-bit op 16.7 ms (67%)" in line and "0.18 ms in its 23 C++ kernel calls" in line
    bare = {k: v for k, v in OPS.items() if "cpp_fused" not in k}
    assert "not recorded apart" in ownership_line(dict(ops=bare, step_ms=25.0), "the step")


def test_kernel_profile_keeps_a_variants_own_inductor_options():
    own = {"level": 3, "inductor_compile_config": {"cpp.threads": 1}}
    merged = with_kernel_profile(own)
    assert merged == {"level": 3, "inductor_compile_config": {"cpp.threads": 1, "cpp.enable_kernel_profile": True}}
    assert own == {"level": 3, "inductor_compile_config": {"cpp.threads": 1}}  # the variant's own dict untouched
    assert with_kernel_profile() == KERNEL_PROFILE and with_kernel_profile(None) is not KERNEL_PROFILE
