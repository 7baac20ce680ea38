// Runtime CPU feature detection and the instruction-set level the fast kernels run at.
// The project builds without -march flags, so the SIMD kernels are compiled with per-function target
// options and chosen here at run time; DSV41_ISA=scalar|avx2|avx512 forces a level (tests, comparisons).
#pragma once

namespace dsv41 {

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA + F16C, with the OS saving ymm state
  bool avx512 = false;       // AVX-512 F/BW/VL/DQ, with the OS saving zmm and opmask state
  bool avx512_bf16 = false;  // reported only; no kernel depends on it
};

// What the processor and OS support (detected once, by cpuid and xgetbv).
const CpuFeatures& cpu_features();
// The best level the machine supports.
Isa detected_isa();
// The level the kernels use: DSV41_ISA when set (lowered to what the machine supports), else the
// detected one. Read once, at the first call.
Isa active_isa();
// Overrides the active level for the whole process (tests and benchmarks); lowered to the detected
// level. Not to be called while kernels run on other threads.
void set_active_isa(Isa isa);
// True when `isa` can run here.
bool isa_supported(Isa isa);

const char* isa_name(Isa isa);
// The active level's name: "scalar", "avx2" or "avx512".
const char* isa_name();

}  // namespace dsv41
