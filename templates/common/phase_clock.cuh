// Per-phase cycle counts of the profiling records (test-only: bench/chunk_profile.py, bench/walk_profile.py).
// A kernel marks the end of each phase; with kOn false (every shipped record) the clock is an empty object
// and its marks compile to nothing, so the shipped code is the same with or without the marks.
#pragma once

namespace kda {

__device__ __forceinline__ long long cycle_count() { return clock64(); }

// kSum: a phase's cycles summed over its repeats (a walk's steps); else the last repeat's.
template <bool kOn, int kPhases, bool kSum>
struct PhaseClock {
  long long cycles[kPhases] = {};
  long long last;
  __device__ __forceinline__ PhaseClock() : last(cycle_count()) {}
  __device__ __forceinline__ void mark(int i) {
    const long long now = cycle_count();
    cycles[i] = kSum ? cycles[i] + (now - last) : now - last;
    last = now;
  }
  __device__ __forceinline__ long long phase(int i) const { return cycles[i]; }
};

template <int kPhases, bool kSum>
struct PhaseClock<false, kPhases, kSum> {
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ long long phase(int) const { return 0; }
};

}  // namespace kda
