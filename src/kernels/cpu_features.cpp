// cpuid + xgetbv feature detection (Intel SDM vol. 2A "CPUID", vol. 1 §13 "XSAVE-enabled features").
#include "kernels/cpu_features.h"

#include "kernels/linear_internal.h"
#include "util/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define DSV41_X86 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dsv41 {

namespace {

#if DSV41_X86
// XCR0 says which register states the OS saves on a context switch: a CPU flag alone is not enough,
// since using ymm/zmm registers the OS does not save would corrupt them across threads.
unsigned long long xcr0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if DSV41_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = (c & (1u << 12)) != 0;
  const bool osxsave = (c & (1u << 27)) != 0;
  const bool avx = (c & (1u << 28)) != 0;
  const bool f16c = (c & (1u << 29)) != 0;
  if (!osxsave || !avx) return f;
  const unsigned long long xcr = xcr0();
  const bool os_ymm = (xcr & 0x6) == 0x6;     // SSE + AVX state
  const bool os_zmm = (xcr & 0xE6) == 0xE6;   // + opmask, upper zmm0-15, zmm16-31
  const bool os_tiles = (xcr & 0x60000) == 0x60000;  // XTILECFG + XTILEDATA
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = (b & (1u << 5)) != 0;
  const bool avx512f = (b & (1u << 16)) != 0;
  const bool avx512dq = (b & (1u << 17)) != 0;
  const bool avx512bw = (b & (1u << 30)) != 0;
  const bool avx512vl = (b & (1u << 31)) != 0;
  const bool avx512vnni = (c & (1u << 11)) != 0;
  const bool avx512vbmi = (c & (1u << 1)) != 0;
  const unsigned max_sub = a;
  const bool amx_bf16 = (d & (1u << 22)) != 0;
  const bool amx_tile = (d & (1u << 24)) != 0;
  bool bf16 = false;
  if (max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) bf16 = (a & (1u << 5)) != 0;
  f.avx2 = os_ymm && avx2 && fma && f16c;
  f.avx512 = f.avx2 && os_zmm && avx512f && avx512dq && avx512bw && avx512vl;
  f.avx512_bf16 = f.avx512 && bf16;
  f.avx512_vnni = f.avx512 && avx512vnni;
  f.avx512_vbmi = f.avx512 && avx512vbmi;
  f.bf16_dot_in_order = f.avx512_bf16 && detail::bf16_dot_rounds_in_order();
  if (f.avx512_bf16) f.bf16_dot_over_fma = detail::bf16_dot_over_fma_rate();
  f.amx_bf16 = os_tiles && amx_tile && amx_bf16;
#if defined(__linux__)
  // arch/x86/include/uapi/asm/prctl.h: ARCH_REQ_XCOMP_PERM; XFEATURE_XTILEDATA is state component 18.
  // Granted once for the whole process (the kernel's state, not ours); asking again is harmless.
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  f.amx_permitted = f.amx_bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#endif
#endif
  return f;
}

Isa best(const CpuFeatures& f) {
  if (f.amx_permitted && f.avx512_bf16 && f.bf16_dot_in_order) return Isa::amx_bf16;
  if (f.avx512_bf16 && f.bf16_dot_in_order) return Isa::avx512_bf16;
  if (f.avx512) return Isa::avx512;
  if (f.avx2) return Isa::avx2;
  return Isa::scalar;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa detected_isa() { return best(cpu_features()); }

Isa default_isa() {
  // The AMX level's sums are not the reference's chains (simd_amx.cpp): it runs when asked for.
  Isa top = detected_isa();
  while (!isa_gives_reference_bits(top)) top = static_cast<Isa>(static_cast<int>(top) - 1);
  return top == Isa::avx512_bf16 && cpu_features().bf16_dot_over_fma < 1.0 ? Isa::avx512 : top;
}

bool isa_supported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(detected_isa()); }

bool isa_gives_reference_bits(Isa isa) { return isa != Isa::amx_bf16; }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx_bf16:
      return "amx_bf16";
    case Isa::avx512_bf16:
      return "avx512_bf16";
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    case Isa::scalar:
      break;
  }
  return "scalar";
}

Isa parse_isa(const std::string& name, const std::string& where) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}) {
    if (name == isa_name(isa)) return isa;
  }
  fail(where, "must be scalar, avx2, avx512, avx512_bf16 or amx_bf16, got \"" + name + "\"");
}

}  // namespace dsv41
