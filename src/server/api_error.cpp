#include "server/api_error.h"

namespace dsv41::server {

ApiError invalid_request(const std::string& param, const std::string& message, const std::string& code) {
  return ApiError(400, "invalid_request_error", message, param, code);
}

ApiError server_error(const std::string& message) { return ApiError(500, "server_error", message); }

ApiError api_error_from(const Error& error) {
  switch (error.kind()) {
    case ErrorKind::Unavailable:
      return ApiError(503, "server_error", error.what());
    case ErrorKind::InvalidInput:
      break;
  }
  return invalid_request(error.where(), error.what());
}

nlohmann::json error_body(const ApiError& error) {
  auto or_null = [](const std::string& s) { return s.empty() ? nlohmann::json(nullptr) : nlohmann::json(s); };
  return {{"error",
           {{"message", error.message}, {"type", error.type}, {"param", or_null(error.param)},
            {"code", or_null(error.code)}}}};
}

}  // namespace dsv41::server
