#include "backend_env.h"

#include <cstdlib>
#include <string>

#include "util/error.h"

namespace dsv41::cli {

namespace {

const char* variable(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

BackendOptions backend_options_from_environment() {
  BackendOptions o;
  if (const char* isa = variable("DSV41_ISA")) o.level = parse_isa(isa, "DSV41_ISA");
  if (const char* threads = variable("DSV41_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(threads, &end, 10);
    if (end == threads || *end != '\0' || v < 1 || v > 1024) {
      fail("DSV41_THREADS", "must be a number of threads from 1 to 1024, got \"" + std::string(threads) + "\"");
    }
    o.threads = static_cast<int>(v);
  }
  if (const char* pack = variable("DSV41_PACK")) {
    const std::string p = pack;
    if (p != "0" && p != "1") fail("DSV41_PACK", "must be 0 (keep the checkpoint's layout) or 1, got \"" + p + "\"");
    o.pack_weights = p == "1";
  }
  return o;
}

std::shared_ptr<const Backend> backend_from_environment() {
  const BackendOptions o = backend_options_from_environment();
  return make_backend(o, o.level ? "DSV41_ISA" : "backend");
}

}  // namespace dsv41::cli
