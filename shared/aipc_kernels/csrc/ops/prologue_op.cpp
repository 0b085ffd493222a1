// CPU kernel of aipc::prologue (a decoder layer's RMSNorm or SwiGLU product in one pass, at transformers' rounding
// points: aipc_kernels.decoder.prologue), registered with the dispatcher through PyTorch's stable ABI like
// aipc::rope (rope_op.cpp). The low-bit projections of the fused decoder layer call it before aipc::lowbit_linear:
// one pass where transformers' RMSNorm is seven torch ops. The kernel is the C library's aipc_dense_prologue,
// handed over at load by aipc_prologue_op_bind. The schema, the reference and the fake kernel are in
// aipc_kernels/decoder/prologue.py.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dtype_code.h"

namespace {

using torch::stable::Tensor;

decltype(&aipc_dense_prologue) g_prologue = nullptr;

Tensor prologue(Tensor x, int64_t kind, std::optional<Tensor> gamma, double eps) {
    const char* op = "aipc::prologue";
    STD_TORCH_CHECK(g_prologue != nullptr, op,
                    ": the native kernel library is not bound (aipc_kernels.core.native loads it)");
    STD_TORCH_CHECK(kind >= AIPC_PRO_NONE && kind < AIPC_PRO_COUNT, op, ": prologue code ", kind,
                    " is not one of 0 (none), 1 (rmsnorm), 2 (silu_mul)");
    const int dt = aipc_dtype_code(x.scalar_type());
    STD_TORCH_CHECK(dt >= 0, op, ": x must be float32, bfloat16 or float16");
    STD_TORCH_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) > 0, op, ": x must have a non-empty last dimension");
    Tensor xc = x.is_contiguous() ? x : torch::stable::contiguous(x);
    const int64_t cols = xc.size(xc.dim() - 1);
    STD_TORCH_CHECK(kind != AIPC_PRO_SILU_MUL || cols % 2 == 0, op, ": silu_mul needs x's [gate | up] halves, an even "
                    "number of columns; got ", cols);
    const int64_t K = kind == AIPC_PRO_SILU_MUL ? cols / 2 : cols;
    const int64_t M = xc.numel() / cols;
    std::optional<Tensor> gc;  // a contiguous gamma, alive during the call
    if (kind == AIPC_PRO_RMSNORM) {
        STD_TORCH_CHECK(gamma.has_value() && gamma->dim() == 1 && gamma->size(0) == K, op,
                        ": rmsnorm needs gamma of shape (", K, ",)");
        STD_TORCH_CHECK(gamma->scalar_type() == x.scalar_type(), op, ": gamma must have x's dtype");
        gc = gamma->is_contiguous() ? *gamma : torch::stable::contiguous(*gamma);
    }
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < xc.dim() - 1; d++) shape.push_back(xc.size(d));
    shape.push_back(K);
    Tensor out = torch::stable::new_empty(xc, shape);
    const float e = static_cast<float>(eps);
    const void* g = gc.has_value() ? gc->data_ptr() : nullptr;
    const int status = g_prologue(xc.data_ptr(), dt, M, K, cols, static_cast<int>(kind), g, e, out.data_ptr(),
                                  static_cast<int>(torch::stable::get_num_threads()));
    STD_TORCH_CHECK(status == 0, op, " failed with status ", status);
    return out;
}

}  // namespace

// Called once by aipc_kernels.core.native with the kernel library's aipc_dense_prologue; returns the ABI version
// this unit was compiled against (the caller refuses a mismatch).
extern "C" AIPC_API int aipc_prologue_op_bind(void* prologue_fn) {
    g_prologue = reinterpret_cast<decltype(g_prologue)>(prologue_fn);
    return AIPC_ABI_VERSION;
}

STABLE_TORCH_LIBRARY_IMPL(aipc, CPU, m) { m.impl("prologue", TORCH_BOX(&prologue)); }
