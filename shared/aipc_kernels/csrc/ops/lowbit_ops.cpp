// CPU kernels of the planned low-bit ops (aipc::lowbit_linear_cpu, aipc::lowbit_linear_a16_cpu), registered
// with the dispatcher through PyTorch's stable ABI (torch/csrc/stable: one build runs on later torch
// releases too). Decode calls one per linear layer per token; the Python kernel they replace cost
// 20-80 us a call in the dispatcher's call into Python, the operand checks and ctypes. Here a call is
// the shape checks that can change per call (x against the weight the caller checked once at load:
// lowbit_contract.check_operands), the output allocation and the C kernel.
//
// The kernels stay in the C library (_aipc_native), which aipc_kernels.core.native loads with ctypes and
// whose ISA setting tests and benchmarks change: this library does not link it, it is handed the
// library's entry points once at load (aipc_ops_bind), so both paths run the same kernels under the
// same ISA. The schemas and fake kernels are defined in aipc_kernels/ops.py.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "dtype_code.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int64_t kBlockN = 16;  // rows per block of the cpu_vnni16 layout (packing.BLOCK_N)

decltype(&aipc_lowbit_linear) g_lowbit = nullptr;
decltype(&aipc_lowbit_linear_a16) g_a16 = nullptr;
decltype(&aipc_status_message) g_message = nullptr;


// The checks a call can fail although the caller checked the weight once: x's dtype and K, the tensors'
// sizes against (N, K, bits, G), and density (the kernel reads every operand as a dense array).
struct Checked {
    Tensor x;
    std::optional<Tensor> bias;
    int64_t M, K, N;
    int dt, scale_dt;
};

void check_dense(const Tensor& t, const char* op, const char* name) {
    STD_TORCH_CHECK(t.is_cpu() && t.is_contiguous(), op, ": ", name,
                    " must be a dense CPU tensor (the caller packs it once at load)");
}

Checked check(const char* op, const Tensor& x_in, const Tensor& qweight, const Tensor& scales,
              const std::optional<Tensor>& zeros, int64_t bits, int64_t G, int64_t N, bool a16) {
    STD_TORCH_CHECK(g_lowbit != nullptr, op, ": the native kernel library is not bound (aipc_kernels.core.native loads it)");
    STD_TORCH_CHECK(x_in.dim() >= 1, op, ": x must have a feature dimension [..., K]");
    const int dt = aipc_dtype_code(x_in.scalar_type());
    STD_TORCH_CHECK(dt >= 0, op, ": x must be float32, bfloat16 or float16");
    const int64_t K = x_in.size(x_in.dim() - 1);
    STD_TORCH_CHECK(bits > 0 && bits <= 8 && G > 0 && K % G == 0 && K % 32 == 0, op, ": x has K=", K,
                    " features; the weight was packed for bits=", bits, ", group_size=", G,
                    " (K must be a multiple of 32 and of group_size)");
    check_dense(qweight, op, "qweight");
    check_dense(scales, op, "scales");
    STD_TORCH_CHECK(qweight.scalar_type() == ScalarType::Byte, op, ": qweight must be uint8 (cpu_vnni16 layout)");
    const bool two_level = scales.scalar_type() == ScalarType::Char && !a16;  // int8: the two-level form
    const int scale_dt = two_level ? AIPC_SCALE_I8 : aipc_dtype_code(scales.scalar_type());
    STD_TORCH_CHECK(scale_dt == AIPC_DT_BF16 || scale_dt == AIPC_DT_F16 || (scale_dt == AIPC_DT_F32 && !a16) || two_level,
                    op, a16 ? ": scales must be float16 or bfloat16"
                            : ": scales must be float16, bfloat16, float32, or int8 (two-level, with supers)");
    // cpu_vnni16: [ceil(N/16), K*bits/32, 16, 4] codes, [ceil(N/16), K/G, 16] scales
    const int64_t padded = (N + kBlockN - 1) / kBlockN * kBlockN;
    STD_TORCH_CHECK(N > 0 && scales.numel() == padded * (K / G) && qweight.numel() == padded * K * bits / 8, op,
                    ": x has K=", K, " features but the weight holds ", N > 0 ? qweight.numel() * 8 / (padded * bits) : 0,
                    " per row (out_features=", N, ", bits=", bits, ", group_size=", G, ": qweight ", qweight.numel(),
                    " bytes, scales ", scales.numel(), " values in the cpu_vnni16 layout)");
    if (zeros.has_value()) {
        check_dense(*zeros, op, "zeros");
        STD_TORCH_CHECK(zeros->numel() == scales.numel() && zeros->scalar_type() == scales.scalar_type(), op,
                        ": zeros must have scales' shape and dtype");
    }
    return Checked{x_in.is_contiguous() ? x_in : torch::stable::contiguous(x_in), std::nullopt, x_in.numel() / K, K,
                   N, dt, scale_dt};
}

// Takes the bias in x's dtype and returns y, [..., N] like x.
Tensor output(Checked& c, const std::optional<Tensor>& bias, const char* op) {
    const int64_t N = c.N;
    if (bias.has_value()) {
        STD_TORCH_CHECK(bias->numel() == N, op, ": bias has ", bias->numel(), " values; expected out_features=", N);
        Tensor b = *bias;
        if (b.scalar_type() != c.x.scalar_type() || !b.is_contiguous()) {
            b = torch::stable::contiguous(torch::stable::to(b, c.x.scalar_type()));
        }
        c.bias = b;
    }
    std::vector<int64_t> shape(c.x.sizes().begin(), c.x.sizes().end());
    shape.back() = N;
    return torch::stable::new_empty(c.x, shape);
}

void raise_status(int status, const char* op, const Checked& c) {
    STD_TORCH_CHECK(status == 0, op, " failed: ", g_message ? g_message(status) : "status", " (M=", c.M, ", K=", c.K,
                    ", N=", c.N, ")");
}

Tensor lowbit_linear_cpu(Tensor x, Tensor qweight, Tensor scales, std::optional<Tensor> zeros,
                         std::optional<Tensor> bias, int64_t bits, int64_t group_size, int64_t out_features,
                         double cmul, double zero, int64_t act_group, std::optional<Tensor> act_amax, bool mins,
                         std::optional<Tensor> supers) {
    const char* op = "aipc::lowbit_linear_cpu";
    Checked c = check(op, x, qweight, scales, zeros, bits, group_size, out_features, false);
    // the two-level form: float32 [S][ceil(N/16)][K/SB][16] super-block scales, S = 2 with mins; one set with mins:
    // the progressive form ([1][ceil(N/16)][1][16], AIPC_SCALE_I8_PROG)
    int64_t SB = 0;
    STD_TORCH_CHECK(supers.has_value() == (c.scale_dt == AIPC_SCALE_I8), op,
                    ": supers (float32 super-block scales) go with int8 scales (the two-level form), and only with them");
    if (supers.has_value()) {
        check_dense(*supers, op, "supers");
        const bool prog = mins && supers->dim() == 4 && supers->size(0) == 1;
        if (prog) c.scale_dt = AIPC_SCALE_I8_PROG;
        const int64_t blocks = (out_features + kBlockN - 1) / kBlockN, S = mins && !prog ? 2 : 1;
        const int64_t per_row = supers->numel() / (S * blocks * kBlockN);
        STD_TORCH_CHECK(supers->scalar_type() == ScalarType::Float && per_row > 0 &&
                            supers->numel() == S * blocks * per_row * kBlockN && c.K % per_row == 0,
                        op, ": supers must be float32 [", S, ", ", blocks, ", K/SB, 16] (K=", c.K, ")");
        SB = c.K / per_row;
    }
    const float* amax = nullptr;
    if (act_amax.has_value()) {
        check_dense(*act_amax, op, "act_amax");
        STD_TORCH_CHECK(act_amax->scalar_type() == ScalarType::Float && act_amax->numel() == c.M, op,
                        ": act_amax must be float32 with one value per token (M=", c.M, ")");
        amax = static_cast<const float*>(act_amax->data_ptr());
    }
    Tensor y = output(c, bias, op);
    const int64_t span = act_group > 0 ? act_group : c.K;
    // NaN: zeros are per-group zero points; a finite zero with zeros: the min form (zeros are the mins)
    const float zero_const = zeros.has_value() && !mins ? NAN : static_cast<float>(zero);
    const int status = g_lowbit(
        c.x.data_ptr(), c.dt, c.M, c.K, static_cast<const uint8_t*>(qweight.data_ptr()), static_cast<int>(bits),
        out_features, scales.data_ptr(), zeros.has_value() ? zeros->data_ptr() : nullptr, c.scale_dt, group_size,
        static_cast<float>(cmul), zero_const, c.bias.has_value() ? c.bias->data_ptr() : nullptr,
        y.data_ptr(), span, static_cast<int>(torch::stable::get_num_threads()), amax,
        supers.has_value() ? static_cast<const float*>(supers->data_ptr()) : nullptr, SB);
    raise_status(status, op, c);
    return y;
}

Tensor lowbit_linear_a16_cpu(Tensor x, Tensor qweight, Tensor scales, std::optional<Tensor> zeros,
                             std::optional<Tensor> bias, int64_t group_size, int64_t out_features, double zero,
                             int64_t dequant) {
    const char* op = "aipc::lowbit_linear_a16_cpu";
    STD_TORCH_CHECK(g_a16 != nullptr, op, ": the native kernel library is not bound (aipc_kernels.core.native loads it)");
    Checked c = check(op, x, qweight, scales, zeros, 4, group_size, out_features, true);
    Tensor y = output(c, bias, op);
    const int status = g_a16(c.x.data_ptr(), c.dt, c.M, c.K, static_cast<const uint8_t*>(qweight.data_ptr()), 4,
                             out_features, scales.data_ptr(), zeros.has_value() ? zeros->data_ptr() : nullptr,
                             c.scale_dt, group_size, zeros.has_value() ? NAN : static_cast<float>(zero),
                             c.bias.has_value() ? c.bias->data_ptr() : nullptr, y.data_ptr(),
                             static_cast<int>(dequant), static_cast<int>(torch::stable::get_num_threads()));
    raise_status(status, op, c);
    return y;
}

}  // namespace

// Called once by aipc_kernels.core.native with the loaded kernel library's entry points; returns the ABI
// version this unit was compiled against (the caller refuses a mismatch).
extern "C" AIPC_API int aipc_ops_bind(void* lowbit_linear, void* lowbit_linear_a16, void* status_message) {
    g_lowbit = reinterpret_cast<decltype(g_lowbit)>(lowbit_linear);
    g_a16 = reinterpret_cast<decltype(g_a16)>(lowbit_linear_a16);
    g_message = reinterpret_cast<decltype(g_message)>(status_message);
    return AIPC_ABI_VERSION;
}

STABLE_TORCH_LIBRARY_IMPL(aipc, CPU, m) {
    m.impl("lowbit_linear_cpu", TORCH_BOX(&lowbit_linear_cpu));
    m.impl("lowbit_linear_a16_cpu", TORCH_BOX(&lowbit_linear_a16_cpu));
}
