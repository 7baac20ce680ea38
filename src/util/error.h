// One error type for everything a user can get wrong: a file, a config, a flag, a request.
// The message always names the thing (file, tensor, key, flag) and says what was expected. Its kind
// says whose move it is, so a caller (the HTTP layer) can answer without reading the text.
#pragma once

#include <stdexcept>
#include <string>

namespace dsv41 {

enum class ErrorKind {
  InvalidInput,  // the input named by where() is wrong: fixing it fixes the error
  Unavailable,   // nothing is wrong with the input, but it cannot be served now (shutting down)
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, ErrorKind kind = ErrorKind::InvalidInput)
      : std::runtime_error(message), kind_(kind) {}
  Error(ErrorKind kind, std::string where, const std::string& what)
      : std::runtime_error(where + ": " + what), kind_(kind), where_(std::move(where)) {}
  ErrorKind kind() const { return kind_; }
  // The file path, tensor name, config key, flag or request field at fault; empty when not known.
  const std::string& where() const { return where_; }

 private:
  ErrorKind kind_;
  std::string where_;
};

// Throws Error("<where>: <what>") of kind InvalidInput; `where` is a file path, tensor name, config
// key, flag or request field.
[[noreturn]] void fail(const std::string& where, const std::string& what);
// The same of kind Unavailable.
[[noreturn]] void fail_unavailable(const std::string& where, const std::string& what);

}  // namespace dsv41
