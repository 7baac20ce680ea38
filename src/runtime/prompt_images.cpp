#include "runtime/prompt_images.h"

#include <algorithm>

#include "model/vision_tower.h"
#include "util/error.h"

namespace dsv41 {

PromptImages::PromptImages(std::vector<ImageSpan> spans, int64_t dim) : spans_(std::move(spans)), dim_(dim) {
  int64_t end = 0;
  for (const ImageSpan& s : spans_) {
    if (s.start < end || s.length <= 0) fail("images", "spans must be non-empty, ascending and disjoint");
    if (static_cast<int64_t>(s.rows.size()) != s.length * dim_) {
      fail("images", "a span of " + std::to_string(s.length) + " positions needs " + std::to_string(s.length * dim_) +
                         " values, not " + std::to_string(s.rows.size()));
    }
    end = s.start + s.length;
  }
}

const ImageSpan* PromptImages::span_at(int64_t p) const {
  // the last span starting at or before p
  auto it = std::upper_bound(spans_.begin(), spans_.end(), p, [](int64_t v, const ImageSpan& s) { return v < s.start; });
  if (it == spans_.begin()) return nullptr;
  --it;
  return p < it->start + it->length ? &*it : nullptr;
}

int64_t PromptImages::cut_at_or_before(int64_t p) const {
  const ImageSpan* s = span_at(p);
  return s && s->start < p ? s->start : p;
}

int64_t PromptImages::cut_at_or_after(int64_t p) const {
  const ImageSpan* s = span_at(p);
  return s && s->start < p ? s->start + s->length : p;
}

std::shared_ptr<const SpanEmbeddings> PromptImages::slice(int64_t begin, int64_t end) const {
  std::shared_ptr<SpanEmbeddings> out;
  for (const ImageSpan& s : spans_) {
    const int64_t a = std::max(begin, s.start), b = std::min(end, s.start + s.length);
    if (a >= b) continue;
    if (!out) {
      out = std::make_shared<SpanEmbeddings>();
      out->mask.assign(static_cast<size_t>(end - begin), 0);
    }
    std::fill(out->mask.begin() + (a - begin), out->mask.begin() + (b - begin), uint8_t{1});
    out->rows.insert(out->rows.end(), s.rows.begin() + (a - s.start) * dim_, s.rows.begin() + (b - s.start) * dim_);
  }
  return out;
}

std::vector<int32_t> PromptImages::key_tokens(const std::vector<int32_t>& tokens) const {
  std::vector<int32_t> out = tokens;
  for (const ImageSpan& s : spans_) {
    for (int64_t i = 0; i < s.length && s.start + i < static_cast<int64_t>(out.size()); ++i) {
      // 31 bits of a mix of the key and the offset, made negative (never a vocabulary id)
      uint64_t h = (s.key + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
      out[static_cast<size_t>(s.start + i)] = -1 - static_cast<int32_t>(h & 0x7FFFFFFEull);
    }
  }
  return out;
}

std::vector<int64_t> expand_image_placeholders(const ModelConfig& config, std::vector<int32_t>& prompt,
                                               const std::vector<ImageInput>& images) {
  const VisionConfig& v = config.vision;
  const int64_t id = v.image_token_id;
  const int64_t placeholders = id < 0 ? 0 : std::count(prompt.begin(), prompt.end(), static_cast<int32_t>(id));
  if (images.empty()) {
    if (placeholders > 0) fail("prompt", "holds " + std::to_string(placeholders) + " image placeholder(s) but no image");
    return {};
  }
  if (!v.enabled()) fail("images", "this model has no vision tower");
  if (placeholders != static_cast<int64_t>(images.size())) {
    fail("images", std::to_string(images.size()) + " image(s) for " + std::to_string(placeholders) +
                       " placeholder(s) in the prompt: each image fills one, in order");
  }
  std::vector<int32_t> out;
  std::vector<int64_t> starts;
  size_t next = 0;
  for (int32_t t : prompt) {
    if (t != static_cast<int32_t>(id)) {
      out.push_back(t);
      continue;
    }
    const ImageInput& im = images[next++];
    if (im.grid_h <= 0 || im.grid_w <= 0 ||
        static_cast<int64_t>(im.patches.size()) != im.grid_h * im.grid_w * v.patch_values()) {
      fail("images", "image " + std::to_string(next) + " has no patches of this model's patch size");
    }
    const ImageGrid grid{im.grid_h, im.grid_w};
    starts.push_back(static_cast<int64_t>(out.size()));
    out.insert(out.end(), static_cast<size_t>(grid.span_length(v.downsample_ratio)), t);
  }
  prompt = std::move(out);
  return starts;
}

PromptImages encode_prompt_images(const Model& model, const std::vector<ImageInput>& images,
                                  const std::vector<int64_t>& starts) {
  if (images.empty()) return {};
  const ModelConfig& c = model.config();
  if (!model.weights().vision) fail("images", "the checkpoint carries no vision tower (vision.* tensors)");
  const VisionTower tower(model.backend(), *model.weights().vision, c.vision, c.dim);
  std::vector<ImageSpan> spans;
  for (size_t i = 0; i < images.size(); ++i) {
    const ImageGrid grid{images[i].grid_h, images[i].grid_w};
    ImageSpan s;
    s.start = starts.at(i);
    s.length = grid.span_length(c.vision.downsample_ratio);
    s.key = images[i].key;
    s.rows = tower.embed(images[i].patches.data(), grid);
    spans.push_back(std::move(s));
  }
  return PromptImages(std::move(spans), c.dim);
}

}  // namespace dsv41
