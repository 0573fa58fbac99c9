// Argument checking for binding units. Bindings receive tensors as plain descriptors
// (ptr, dtype code, device index, shape, strides in elements) made by kda_aot/_runtime/tensor.py, so
// no torch header is needed and one wheel serves any torch version. Every check raises a
// Python TypeError/ValueError naming the argument, before anything is launched.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/abi.h"

namespace kda {
namespace py = pybind11;

struct Tensor {
  std::string name;
  bool present = false;
  uint64_t ptr = 0;
  int dtype = -1;
  int device = -1;  // CUDA device index, -1 for anything else
  std::vector<int64_t> shape, strides;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};

// No iostreams: std::ostringstream in a binding can crash inside torch's Python when another libstdc++ is
// loaded first; plain std::string formatting does not touch the locale machinery.
inline std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

[[noreturn]] inline void fail_value(const std::string& msg) { throw py::value_error(msg); }
[[noreturn]] inline void fail_type(const std::string& msg) { throw py::type_error(msg); }

// Byte size of a dense tensor, refusing int64 overflow.
inline int64_t checked_bytes(const Tensor& t) {
  int64_t n = dtype_size(t.dtype);
  for (int64_t s : t.shape) {
    if (s < 0) fail_value(t.name + ": negative size in shape " + join(t.shape));
    if (__builtin_mul_overflow(n, s, &n)) fail_value(t.name + ": byte size overflows int64");
  }
  return n;
}

// obj: None or (ptr, dtype, device, shape, strides).
inline Tensor tensor_arg(const py::handle& obj, const char* name, bool required = true) {
  Tensor t;
  t.name = name;
  if (obj.is_none()) {
    if (required) fail_type(std::string(name) + ": a tensor is required, got None");
    return t;
  }
  py::tuple tup;
  try {
    tup = py::reinterpret_borrow<py::tuple>(obj);
    if (!py::isinstance<py::tuple>(obj) || tup.size() != 5) throw py::type_error("");
    t.ptr = tup[0].cast<uint64_t>();
    t.dtype = tup[1].cast<int>();
    t.device = tup[2].cast<int>();
    t.shape = tup[3].cast<std::vector<int64_t>>();
    t.strides = tup[4].cast<std::vector<int64_t>>();
  } catch (const py::cast_error&) {
    fail_type(std::string(name) + ": expected a tensor descriptor (ptr, dtype, device, shape, strides)");
  } catch (const py::type_error&) {
    fail_type(std::string(name) + ": expected a tensor descriptor (ptr, dtype, device, shape, strides)");
  }
  if (t.shape.size() != t.strides.size()) fail_value(t.name + ": shape and strides differ in rank");
  t.present = true;
  checked_bytes(t);
  return t;
}

inline void expect_dtype(const Tensor& t, int dtype) {
  if (t.dtype != dtype)
    fail_type(t.name + ": expected dtype " + dtype_name(dtype) + ", got " + dtype_name(t.dtype));
}

inline void expect_dtype2(const Tensor& t, int a, int b) {
  if (t.dtype != a && t.dtype != b)
    fail_type(t.name + ": expected dtype " + dtype_name(a) + " or " + dtype_name(b) + ", got " +
              dtype_name(t.dtype));
}

// expected: exact sizes, -1 = any size.
inline void expect_shape(const Tensor& t, const std::vector<int64_t>& expected, const char* spelled) {
  bool ok = t.shape.size() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) ok = expected[i] < 0 || expected[i] == t.shape[i];
  if (!ok) fail_value(t.name + ": expected shape " + spelled + " = " + join(expected) + ", got " + join(t.shape));
}

inline void expect_contiguous(const Tensor& t) {
  int64_t stride = 1;
  for (int i = static_cast<int>(t.shape.size()) - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != stride)
      fail_value(t.name + ": expected contiguous storage, got strides " + join(t.strides) + " for shape " +
                 join(t.shape));
    stride *= t.shape[i];
  }
}

inline void expect_aligned(const Tensor& t, uint64_t bytes) {
  if (t.ptr % bytes != 0)
    fail_value(t.name + ": storage must be " + std::to_string(bytes) + "-byte aligned (data_ptr % " +
               std::to_string(bytes) + " = " + std::to_string(t.ptr % bytes) + ")");
}

// All present tensors on one CUDA device; returns it.
inline int expect_one_cuda_device(const std::vector<const Tensor*>& ts) {
  int device = -2;
  std::string first;
  for (const Tensor* t : ts) {
    if (!t->present) continue;
    if (t->device < 0)
      fail_value(t->name + ": expected a CUDA tensor (kda_aot's kernels run on a CUDA GPU; on the CPU, kda_aot.reference "
                           "holds the same math in fp64)");
    if (device == -2) {
      device = t->device;
      first = t->name;
    } else if (t->device != device) {
      fail_value(t->name + ": on cuda:" + std::to_string(t->device) + " but " + first + " is on cuda:" +
                 std::to_string(device));
    }
  }
  return device;
}

// Export the dtype codes so tests can check kda_aot/_runtime/tensor.py agrees with this header.
inline void export_abi(py::module_& m) {
  py::dict codes;
  for (int c : {kFloat32, kBFloat16, kFloat16, kInt32, kInt64, kFloat64}) codes[dtype_name(c)] = c;
  m.attr("DTYPE_CODES") = codes;
}

// Launch result of a kernel unit: 0 or a CUDA error code with its message in `err`.
inline void check_launch(int code, const char* err, const char* what) {
  if (code != 0) throw std::runtime_error(std::string(what) + ": CUDA error " + std::to_string(code) + ": " + err);
}

}  // namespace kda
