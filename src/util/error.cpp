#include "util/error.h"

namespace dsv41 {

void fail(const std::string& where, const std::string& what) { throw Error(where + ": " + what); }

}  // namespace dsv41
