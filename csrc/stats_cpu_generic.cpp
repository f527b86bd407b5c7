// CPU block kernels, portable build (the compiler's baseline SIMD: SSE2 on x86-64, NEON on
// aarch64). See stats_cpu_kernel.h.
#include <stdint.h>

#include "stats_cpu_iface.h"
#include "stats_defs.h"

#define HOOKPLUG_KNS generic
#define HOOKPLUG_ISA_NAME "generic"
#define HOOKPLUG_F16C 0
#define HOOKPLUG_FMA 0
#define HOOKPLUG_VBYTES 16
#include "stats_cpu_kernel.h"

namespace hookplug {
namespace cpu {
const KernelTable* kernels_generic() { return &generic::kTable; }
}  // namespace cpu
}  // namespace hookplug
