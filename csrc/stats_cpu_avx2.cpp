// CPU block kernels built for AVX2 + FMA + F16C (x86-64 with GCC or Clang), selected at
// run time when the CPU supports them. Only torch-free, STL-free code follows the target
// pragma, so no inline function shared with other translation units gets AVX2 code.
// See stats_cpu_kernel.h.
#include <stdint.h>

#include "stats_cpu_iface.h"
#include "stats_defs.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define HOOKPLUG_KNS avx2
#define HOOKPLUG_ISA_NAME "avx2"
#define HOOKPLUG_F16C 1
#define HOOKPLUG_FMA 1
#define HOOKPLUG_VBYTES 32
#include "stats_cpu_kernel.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace hookplug {
namespace cpu {
const KernelTable* kernels_avx2() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return &avx2::kTable;
  }
  return nullptr;
}
}  // namespace cpu
}  // namespace hookplug

#else  // not x86-64 GCC/Clang

namespace hookplug {
namespace cpu {
const KernelTable* kernels_avx2() { return nullptr; }
}  // namespace cpu
}  // namespace hookplug

#endif
