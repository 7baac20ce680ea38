#include "test_paths.h"

namespace dsv41::test {

std::string source_dir() { return DSV41_SOURCE_DIR; }
std::string dsv41_binary() { return DSV41_BINARY; }

}  // namespace dsv41::test
