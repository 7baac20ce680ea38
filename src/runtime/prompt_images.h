// A prompt's images as spans of its positions (vision-spec §3.5, §6): where each span starts, its
// length, its rows (what the vision tower and the span assembly made of the image) and a key (a
// hash of the image's content and its preprocessing). Every span position carries the same token
// id, so the prompt cache and the Engram history see a prompt through its key tokens instead: each
// span position becomes a negative id derived from its image's key and its offset, so two prompts
// share a cached prefix only where their images are the same, and a negative id reads as DEAD to
// Model::engram_history.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/model.h"
#include "runtime/image_input.h"

namespace dsv41 {

struct ImageSpan {
  int64_t start = 0, length = 0;
  uint64_t key = 0;
  std::vector<float> rows;  // [length, dim]: start, the aligner rows with a newline after each grid row, end
};

class PromptImages {
 public:
  PromptImages() = default;
  // Spans ascending and disjoint, each with length·dim rows (Error otherwise).
  PromptImages(std::vector<ImageSpan> spans, int64_t dim);
  bool empty() const { return spans_.empty(); }
  const std::vector<ImageSpan>& spans() const { return spans_; }

  // The span that holds position p, or null.
  const ImageSpan* span_at(int64_t p) const;
  // p, or the start of the span p falls strictly inside: where a prompt may be cut (a chunk's end, a
  // cache boundary, a replay's start) without cutting a span.
  int64_t cut_at_or_before(int64_t p) const;
  // p, or the end of the span p falls strictly inside.
  int64_t cut_at_or_after(int64_t p) const;
  // The spans' part of a forward call over positions [begin, end), null when no span reaches it.
  std::shared_ptr<const SpanEmbeddings> slice(int64_t begin, int64_t end) const;
  // `tokens` with every span position replaced by its key token (negative).
  std::vector<int32_t> key_tokens(const std::vector<int32_t>& tokens) const;

 private:
  std::vector<ImageSpan> spans_;
  int64_t dim_ = 0;
};

// vision-spec §3.5: each image placeholder (the config's image_token_id) of `prompt` becomes its
// image's span, every position carrying the placeholder's id; images in order. Returns the spans'
// starts. Error when the placeholders and the images do not pair up, or the model has no vision tower.
std::vector<int64_t> expand_image_placeholders(const ModelConfig& config, std::vector<int32_t>& prompt,
                                               const std::vector<ImageInput>& images);

// The images' spans at `starts` (from expand_image_placeholders): each image through the vision
// tower and the span assembly (model/vision_tower.h). Runs on the model's backend.
PromptImages encode_prompt_images(const Model& model, const std::vector<ImageInput>& images,
                                  const std::vector<int64_t>& starts);

}  // namespace dsv41
