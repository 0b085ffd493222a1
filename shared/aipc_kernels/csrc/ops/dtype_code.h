// The C library's dtype code (aipc_dtype) of a torch scalar type, -1 for one the kernels do not take; shared by
// the stable-ABI op units of this folder.
#pragma once

#include <torch/headeronly/core/ScalarType.h>

extern "C" {
#include "../aipc_native.h"
}

inline int aipc_dtype_code(torch::headeronly::ScalarType t) {
    switch (t) {
        case torch::headeronly::ScalarType::Float: return AIPC_DT_F32;
        case torch::headeronly::ScalarType::BFloat16: return AIPC_DT_BF16;
        case torch::headeronly::ScalarType::Half: return AIPC_DT_F16;
        default: return -1;
    }
}
