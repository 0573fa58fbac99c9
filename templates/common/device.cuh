// Small device helpers shared by kernel units.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace kda {

// 16-byte read-only load (8 bf16) that bypasses L1 allocation for streaming rows.
__device__ __forceinline__ uint4 load_nc_16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint2 load_nc_8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

__device__ __forceinline__ void unpack_bf16(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// Two floats to a bf16 pair (round to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// C consecutive bf16 as loaded (C = 4 or 8: one 8- or 16-byte access), kept packed in registers
// until used so that many rows can be in flight per thread.
template <int C>
struct Bf16Vec {
  static_assert(C == 4 || C == 8, "4 or 8 bf16 per access");
  uint32_t w[C / 2];

  __device__ __forceinline__ void load(const uint16_t* p) {
    if constexpr (C == 8) {
      const uint4 v = load_nc_16(p);
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
      const uint2 v = load_nc_8(p);
      w[0] = v.x; w[1] = v.y;
    }
  }

  __device__ __forceinline__ void unpack(float (&f)[C]) const {
#pragma unroll
    for (int i = 0; i < C / 2; ++i) unpack_bf16(w[i], f[2 * i], f[2 * i + 1]);
  }
};

template <int C>
__device__ __forceinline__ void load_bf16(float (&f)[C], const uint16_t* p) {
  Bf16Vec<C> v;
  v.load(p);
  v.unpack(f);
}

template <int C>
__device__ __forceinline__ void store_bf16(uint16_t* p, const float (&f)[C]) {
  static_assert(C == 4 || C == 8, "4 or 8 bf16 per access");
  if constexpr (C == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]),
                                              pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  } else {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]));
  }
}

// C consecutive floats (C a multiple of 4) to 16-byte aligned global memory.
template <int C>
__device__ __forceinline__ void store_f32(float* p, const float (&f)[C]) {
  static_assert(C % 4 == 0, "whole float4s");
#pragma unroll
  for (int i = 0; i < C / 4; ++i)
    reinterpret_cast<float4*>(p)[i] = make_float4(f[4 * i], f[4 * i + 1], f[4 * i + 2], f[4 * i + 3]);
}

// Largest s in [0, n) with cu[s] <= t, for strictly increasing cu[0..n] with cu[0] = 0 <= t < cu[n].
template <typename Idx>
__device__ __forceinline__ int64_t find_segment(const Idx* cu, int64_t n, int64_t t) {
  int64_t lo = 0, hi = n;  // invariant: cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(cu[mid]) <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// Launch epilogue of kernel units: report the launch error with its message.
inline int launch_status(char* err, int errlen) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess && err && errlen > 0) snprintf(err, errlen, "%s", cudaGetErrorString(e));
  return static_cast<int>(e);
}

// A failed runtime call's code, with its message in err; the thread's last-error slot is cleared, so that the
// next launch's launch_status does not report this call's error as its own.
inline int report(cudaError_t e, char* err, int errlen) {
  if (err && errlen > 0) snprintf(err, errlen, "%s", cudaGetErrorString(e));
  cudaGetLastError();
  return static_cast<int>(e);
}

// The driver's cuCtxGetCurrent / cuCtxSetCurrent, looked up once through the runtime (the modules link no
// libcuda); null where the lookup fails.
struct DriverContextCalls {
  int (*get_current)(void** context) = nullptr;
  int (*set_current)(void* context) = nullptr;
};

inline const DriverContextCalls& driver_context_calls() {
  static const DriverContextCalls calls = [] {
    DriverContextCalls c;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult found_get = cudaDriverEntryPointSymbolNotFound, found_set = found_get;
#if CUDART_VERSION >= 12050
    cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &found_get);
    cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &found_set);
#else
    cudaGetDriverEntryPoint("cuCtxGetCurrent", &get, cudaEnableDefault, &found_get);
    cudaGetDriverEntryPoint("cuCtxSetCurrent", &set, cudaEnableDefault, &found_set);
#endif
    cudaGetLastError();
    if (found_get == cudaDriverEntryPointSuccess && found_set == cudaDriverEntryPointSuccess && get && set) {
      c.get_current = reinterpret_cast<int (*)(void**)>(get);
      c.set_current = reinterpret_cast<int (*)(void*)>(set);
    }
    return c;
  }();
  return calls;
}

// The caller's tensors' device made current for one launch: a process may drive several GPUs from one thread,
// and a kernel (and cudaFuncSetAttribute) goes to the current device. Where that is another device, the
// thread's driver context before the switch is bound again after the launch, exactly (none included): setting
// the previous device back instead would create a primary context on a GPU the thread never used.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    int current = -1;
    status_ = cudaGetDevice(&current);
    if (status_ != cudaSuccess || current == device) return;
    const DriverContextCalls& driver = driver_context_calls();
    if (driver.get_current && driver.get_current(&previous_context_) == 0) {
      restore_ = kContext;
    } else {
      restore_ = kDevice;
      previous_device_ = current;
    }
    status_ = cudaSetDevice(device);
    if (status_ != cudaSuccess) restore_ = kNothing;
  }
  ~DeviceScope() {
    if (restore_ == kContext) driver_context_calls().set_current(previous_context_);
    else if (restore_ == kDevice && cudaSetDevice(previous_device_) != cudaSuccess) cudaGetLastError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  enum Restore { kNothing, kContext, kDevice };
  Restore restore_ = kNothing;
  void* previous_context_ = nullptr;
  int previous_device_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// Launch `kernel` on `device` with `smem` bytes of dynamic shared memory (raising the opt-in limit first).
template <typename Kernel, typename Args>
inline int launch_kernel(Kernel kernel, dim3 grid, int threads, int smem, int device, void* stream, const Args& args,
                         char* err, int errlen) {
  const DeviceScope on(device);
  if (on.status() != cudaSuccess) return report(on.status(), err, errlen);
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return report(e, err, errlen);
  kernel<<<grid, threads, smem, static_cast<cudaStream_t>(stream)>>>(args);
  return launch_status(err, errlen);
}

}  // namespace kda
