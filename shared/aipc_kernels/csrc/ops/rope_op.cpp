// CPU kernel of aipc::rope (transformers' rotary embedding in one pass, aipc_kernels.decoder.rope), registered with
// the dispatcher through PyTorch's stable ABI like the planned low-bit ops (lowbit_ops.cpp): a decode step
// calls it once per layer, where the three torch element-wise ops it replaces cost about 30 us from Python.
// The kernel is the C library's aipc_rope, handed over at load by aipc_rope_op_bind. The schema, the
// reference and the fake kernel are in aipc_kernels/rope.py.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <vector>

#include "dtype_code.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

decltype(&aipc_rope) g_rope = nullptr;


Tensor rope(Tensor x, Tensor cos, Tensor sin) {
    const char* op = "aipc::rope";
    STD_TORCH_CHECK(g_rope != nullptr, op, ": the native kernel library is not bound (aipc_kernels.core.native loads it)");
    STD_TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, op, ": x must be [B, L, heads, head_dim] with a dense last "
                    "dimension");
    const int dt = aipc_dtype_code(x.scalar_type());
    STD_TORCH_CHECK(dt >= 0, op, ": x must be float32, bfloat16 or float16");
    const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3);
    STD_TORCH_CHECK(cos.dim() == 3 && sin.dim() == 3 && cos.size(0) == sin.size(0) && cos.size(1) == L &&
                        sin.size(1) == L && cos.size(2) == sin.size(2) && (cos.size(0) == 1 || cos.size(0) == B),
                    op, ": cos and sin must be [B or 1, L, rotary_dim] for x of B=", B, ", L=", L);
    const int64_t R = cos.size(2);
    STD_TORCH_CHECK(R > 0 && R <= D && R % 2 == 0, op, ": rotary_dim=", R, " must be even and at most head_dim=", D);
    STD_TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), op,
                    ": cos and sin must have x's dtype (transformers' rotary embedding returns them in it)");
    Tensor c = cos.is_contiguous() ? cos : torch::stable::contiguous(cos);
    Tensor s = sin.is_contiguous() ? sin : torch::stable::contiguous(sin);
    std::vector<int64_t> shape{B, L, H, D};
    Tensor out = torch::stable::new_empty(x, shape);
    const int status = g_rope(x.data_ptr(), dt, B, L, H, D, x.stride(0), x.stride(1), x.stride(2), c.data_ptr(),
                              s.data_ptr(), c.size(0) == 1 ? 0 : L * R, R, out.data_ptr(),
                              static_cast<int>(torch::stable::get_num_threads()));
    STD_TORCH_CHECK(status == 0, op, " failed with status ", status);
    return out;
}

}  // namespace

// Called once by aipc_kernels.core.native with the kernel library's aipc_rope; returns the ABI version this unit
// was compiled against (the caller refuses a mismatch).
extern "C" AIPC_API int aipc_rope_op_bind(void* rope_fn) {
    g_rope = reinterpret_cast<decltype(g_rope)>(rope_fn);
    return AIPC_ABI_VERSION;
}

STABLE_TORCH_LIBRARY_IMPL(aipc, CPU, m) { m.impl("rope", TORCH_BOX(&rope)); }
