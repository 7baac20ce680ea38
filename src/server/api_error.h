// Every way a request can be refused, as one value the HTTP layer renders as the OpenAI error body
// {"error": {"message", "type", "param", "code"}} with its status. Validation throws it; nothing
// below the HTTP layer needs to know about status codes.
#pragma once

#include <exception>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsv41::server {

struct ApiError : std::exception {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // the request field at fault; empty renders as null
  std::string code;   // a machine-readable reason (e.g. "model_not_found"); empty renders as null

  ApiError() = default;
  ApiError(int status_, std::string type_, std::string message_, std::string param_ = "", std::string code_ = "")
      : status(status_), type(std::move(type_)), message(std::move(message_)), param(std::move(param_)),
        code(std::move(code_)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// 400 invalid_request_error about `param`.
ApiError invalid_request(const std::string& param, const std::string& message, const std::string& code = "");
// 500 server_error: something failed that the client could not have prevented.
ApiError server_error(const std::string& message);

// The answer to an error the engine raised, from its kind: 400 about the request field it names for
// bad input, 503 when it cannot serve now.
ApiError api_error_from(const Error& error);

nlohmann::json error_body(const ApiError& error);

}  // namespace dsv41::server
