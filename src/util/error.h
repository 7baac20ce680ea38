// One error type for everything a user can get wrong: a file, a config, a flag, a request.
// The message always names the thing (file, tensor, key, flag) and says what was expected.
#pragma once

#include <stdexcept>
#include <string>

namespace dsv41 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error("<where>: <what>"); `where` is a file path, tensor name, config key or flag.
[[noreturn]] void fail(const std::string& where, const std::string& what);

}  // namespace dsv41
