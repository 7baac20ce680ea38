#include "util/error.h"

namespace dsv41 {

void fail(const std::string& where, const std::string& what) { throw Error(ErrorKind::InvalidInput, where, what); }

void fail_unavailable(const std::string& where, const std::string& what) {
  throw Error(ErrorKind::Unavailable, where, what);
}

}  // namespace dsv41
