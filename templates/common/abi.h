// C ABI shared by kernel units and binding units: dtype codes and plain argument structs.
// No CUDA, torch or pybind11 here, so both sides of a record include it.
#pragma once
#include <cstdint>

namespace kda {

// Mirrored by kda_aot/_runtime/tensor.py (DTYPE_CODES); every binding exports these so a test can
// check the two sides agree.
enum DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat64 = 5,
};

inline const char* dtype_name(int code) {
  switch (code) {
    case kFloat32: return "float32";
    case kBFloat16: return "bfloat16";
    case kFloat16: return "float16";
    case kInt32: return "int32";
    case kInt64: return "int64";
    case kFloat64: return "float64";
    default: return "unknown";
  }
}

inline int dtype_size(int code) {
  switch (code) {
    case kFloat32: case kInt32: return 4;
    case kBFloat16: case kFloat16: return 2;
    case kInt64: case kFloat64: return 8;
    default: return 0;
  }
}

}  // namespace kda
