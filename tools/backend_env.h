// The backend every command runs on, configured from the environment (README, "Environment"):
// DSV41_ISA=scalar|avx2|avx512 (kernel level; default the best the machine runs), DSV41_THREADS=N
// (worker threads; default one per core), DSV41_PACK=0 (keep the checkpoint's weight layout).
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace dsv41::cli {

// Error naming the variable for a value it cannot take (or a level the machine does not run).
BackendOptions backend_options_from_environment();
std::shared_ptr<const Backend> backend_from_environment();

}  // namespace dsv41::cli
