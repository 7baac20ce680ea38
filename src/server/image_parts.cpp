#include "server/image_parts.h"

#include <boost/beast/core/detail/base64.hpp>

#include "runtime/image_prepare.h"
#include "server/api_error.h"
#include "util/error.h"

namespace dsv41::server {

namespace {

using ojson = nlohmann::ordered_json;

// Strict base64 (RFC 4648, padding optional, no whitespace): the bytes, or a 400 naming `where`.
std::vector<uint8_t> base64_bytes(const std::string& text, const std::string& where, const ImageLimits& limits) {
  namespace b64 = boost::beast::detail::base64;
  if (text.empty()) throw invalid_request(where, where + " holds no base64 data");
  if (b64::decoded_size(text.size()) > limits.decode.max_encoded_bytes) {
    throw invalid_request(where, "the image is larger than the server's limit of " +
                                     std::to_string(limits.decode.max_encoded_bytes) + " bytes");
  }
  size_t end = text.size();
  while (end > 0 && text[end - 1] == '=' && text.size() - end < 2) --end;
  std::vector<uint8_t> out(b64::decoded_size(text.size()));
  const auto [written, read] = b64::decode(out.data(), text.data(), end);
  if (read != end) throw invalid_request(where, "is not valid base64 (at character " + std::to_string(read) + ")");
  out.resize(written);
  return out;
}

// The base64 payload of an image record, or a 400 saying why there is none the server takes.
std::string payload(const ojson& record, const std::string& where) {
  const auto text = [&](const ojson& v, const std::string& w) {
    if (!v.is_string()) throw invalid_request(w, w + " must be a string");
    return v.get<std::string>();
  };
  std::string url;
  if (record.contains("url")) url = text(record["url"], where + ".url");
  if (record.contains("source")) {  // Anthropic style: {"type": "base64", "media_type": ..., "data": ...}
    const ojson& s = record["source"];
    if (!s.is_object()) throw invalid_request(where + ".source", "must be an object");
    if (s.contains("data")) return text(s["data"], where + ".source.data");
    if (s.contains("url")) url = text(s["url"], where + ".source.url");
  }
  if (record.contains("data")) return text(record["data"], where + ".data");
  if (url.rfind("data:", 0) == 0) {
    const size_t comma = url.find(',');
    if (comma == std::string::npos || url.substr(0, comma).find(";base64") == std::string::npos) {
      throw invalid_request(where, "a data: URL must be base64 (data:image/png;base64,...)");
    }
    return url.substr(comma + 1);
  }
  if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) {
    throw invalid_request(where, "remote image URLs are not fetched by this server; send the image as a base64 "
                                 "data: URL");
  }
  throw invalid_request(where, "an image must be a base64 data: URL (file paths and other URLs are refused)");
}

}  // namespace

std::vector<ImageInput> load_image_parts(const std::vector<ojson>& records, const VisionConfig* vision,
                                         const ImageLimits& limits) {
  std::vector<ImageInput> out;
  if (records.empty()) return out;
  if (vision == nullptr || !vision->enabled()) {
    throw invalid_request("messages", "this model has no vision tower: image inputs are not supported");
  }
  if (records.size() > limits.max_images) {
    throw invalid_request("messages", std::to_string(records.size()) + " images in one request; the server takes at most " +
                                          std::to_string(limits.max_images));
  }
  // Every image's header first: the pixel limit is the request's, so eight images of the limit each
  // cannot cost eight times it, and none is decoded before the sum is known to fit.
  std::vector<std::vector<uint8_t>> files;
  uint64_t pixels = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const std::string where = "messages: image " + std::to_string(i + 1);
    files.push_back(base64_bytes(payload(records[i], where), where, limits));
    try {
      const ImageHeader h = check_image_header(files.back(), limits.decode, where);
      pixels += static_cast<uint64_t>(h.width) * static_cast<uint64_t>(h.height);
    } catch (const Error& e) {  // corrupt, unsupported or too large: the client's to fix
      throw invalid_request("messages", e.what());
    }
  }
  if (pixels > limits.decode.max_pixels) {
    throw invalid_request("messages", std::to_string(records.size()) + " images of " + std::to_string(pixels) +
                                          " pixels in all, over the limit of " +
                                          std::to_string(limits.decode.max_pixels) + " pixels per request");
  }
  for (size_t i = 0; i < files.size(); ++i) {
    try {
      out.push_back(prepare_image(files[i], *vision, limits.decode, "messages: image " + std::to_string(i + 1)));
    } catch (const Error& e) {  // truncated or corrupt pixels, or a size no plan can carry
      throw invalid_request("messages", e.what());
    }
  }
  return out;
}

}  // namespace dsv41::server
