// Runtime CPU feature detection and the instruction-set levels the kernels come in. The project
// builds without -march flags, so the SIMD kernels are compiled with per-function target options;
// a backend (kernels/backend.h) is made for one level, which must be one the machine runs.
#pragma once

#include <string>

namespace dsv41 {

// Each level includes the ones below it.
// amx_bf16 is the AVX-512-BF16 level with the FP8/FP4 linear layers on the AMX tiles; unlike the
// others it does not give the reference's bits (kernels/simd_amx.cpp), so it is never the default.
enum class Isa { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx_bf16 = 4 };

struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA + F16C, with the OS saving ymm state
  bool avx512 = false;       // AVX-512 F/BW/VL/DQ, with the OS saving zmm and opmask state
  bool avx512_bf16 = false;  // AVX-512 + vdpbf16ps
  bool avx512_vnni = false;  // AVX-512 + vpdpbusd (the indexer's scores in integers, same bits)
  bool avx512_vbmi = false;  // AVX-512 + byte permutes (vpermb, vpermi2b: the decode steps' weights as bf16 pairs)
  // vdpbf16ps rounds each of a lane's two products into the accumulator in turn, the upper first
  // (Intel's definition; probed, since the level's exactness rests on it)
  bool bf16_dot_in_order = false;
  // vdpbf16ps's FLOP rate over vfmadd's, both zmm (timed once, a few milliseconds): 2 where the dot
  // unit issues as many instructions as the FMA, about 0.5 on the development machine's Xeon, where
  // it issues at a quarter of their rate (docs/performance.md). 0 without AVX-512-BF16.
  double bf16_dot_over_fma = 0;
  bool amx_bf16 = false;     // AMX tiles + tdpbf16ps, with the OS able to save tile state (XCR0)
  bool amx_permitted = false;  // and Linux granted this process the tile data (arch_prctl)
};

// What the processor and OS support (detected once, by cpuid and xgetbv; where the CPU has AMX, the
// detection also asks Linux for the tile data, arch_prctl ARCH_REQ_XCOMP_PERM: amx_permitted).
const CpuFeatures& cpu_features();
// The best level the machine supports.
Isa detected_isa();
// The level a backend gets when none is asked for: the best supported level that gives the
// reference's bits, except that AVX-512-BF16 gives way to AVX-512 where its dot unit computes less
// than the FMA (bf16_dot_over_fma < 1). Those levels give the same bits, so that choice is about speed
// alone.
Isa default_isa();
// True when `isa` can run here.
bool isa_supported(Isa isa);
// True for the levels whose every op gives the scalar references' bits (all but amx_bf16).
bool isa_gives_reference_bits(Isa isa);

// "scalar", "avx2", "avx512", "avx512_bf16" or "amx_bf16".
const char* isa_name(Isa isa);
// The level of that name; an Error naming `where` for any other.
Isa parse_isa(const std::string& name, const std::string& where);

}  // namespace dsv41
