// The source folder and the dsv41 binary of this build. They are compiled into one file
// (tests/test_paths.cpp), so every other test object is the same in any checkout and build folder
// and a compiler cache (ccache) shares it between them.
#pragma once

#include <string>

namespace dsv41::test {

std::string source_dir();
std::string dsv41_binary();

}  // namespace dsv41::test
