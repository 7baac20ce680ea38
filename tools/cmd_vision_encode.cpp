// dsv41 vision-encode: one image through the preprocessing, the ViT and the aligner, each stage
// written out in the golden files' layout (tests/golden/tiny-vision/README.md) for comparison with
// another implementation.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "image/image_decode.h"
#include "image/image_preprocess.h"
#include "io/safetensors_writer.h"
#include "model/model.h"
#include "model/vision_tower.h"
#include "model/vision_weights.h"
#include "runtime/image_prepare.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 vision-encode -m DIR --image FILE --dump OUTDIR [--json]

Runs one image through the model's vision path and writes each stage, little-endian and row-major:
  resized.u8    [H, W, 3]          the RGB pixels after convert("RGB") and the fit-and-pad (uint8)
  patches.f32   [N, 3, p, p]       the ViT's input: normalised (bf16 values), row-major patch grid
  vit.f32       [N, vision dim]    the ViT's output after its final norm
  aligner.f32   [L, model dim]     the aligner's rows: the image positions of the span, in order
and prints the plan (sizes, grids, span length).

  -m, --model DIR     model folder with a vision tower (vision.*, aligner.* tensors)
      --image FILE    a PNG or JPEG
      --dump OUTDIR   folder for the four files (made if missing)
      --json          print the plan as one JSON object
)";

template <class T>
void write_array(const std::filesystem::path& file, const std::vector<T>& values) {
  write_file_atomic(file.string(), values.data(), values.size() * sizeof(T));
}

}  // namespace

int run_vision_encode(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("vision-encode", argc, argv, {"--model", "--image", "--dump"}, {"--json"}, {{"-m", "--model"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string dir = args.required("--model"), image_path = args.required("--image"), out = args.required("--dump");
  ModelOptions mo;
  mo.backend = backend_from_environment();
  const auto model = load_model(dir, mo);
  const ModelConfig& c = model->config();
  if (!c.vision.enabled() || !model->weights().vision) fail(dir, "has no vision tower (vision.* and aligner.* tensors)");

  std::ifstream in(image_path, std::ios::binary);
  if (!in) fail(image_path, "cannot be opened");
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(image_path, "could not be read");
  const RgbImage rgb = decode_image(bytes, ImageDecodeLimits{}, image_path);
  const PreprocessedImage p = preprocess_image(rgb, preprocess_config(c.vision));

  const VisionTower tower(model->backend(), *model->weights().vision, c.vision, c.dim);
  const ImageGrid grid{p.plan.n_vit_h, p.plan.n_vit_w};
  const std::vector<float> vit = tower.encode(p.patches.data(), grid);
  const std::vector<float> aligned = tower.align(vit.data(), grid);

  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  if (ec) fail(out, "cannot create folder: " + ec.message());
  const std::filesystem::path o(out);
  write_array(o / "resized.u8", p.resized.pixels);
  write_array(o / "patches.f32", p.patches);
  write_array(o / "vit.f32", vit);
  write_array(o / "aligner.f32", aligned);

  const nlohmann::json plan = {
      {"image", image_path},
      {"size_wh", {rgb.width, rgb.height}},
      {"best_wh", {p.plan.best_w, p.plan.best_h}},
      {"fitted_wh", {p.fitted_w, p.fitted_h}},
      {"pad_offset_xy", {p.pad_x, p.pad_y}},
      {"n_vit_hw", {p.plan.n_vit_h, p.plan.n_vit_w}},
      {"n_llm_hw", {p.plan.n_llm_h, p.plan.n_llm_w}},
      {"num_tokens", p.plan.num_tokens},
      {"content_hash", p.content_hash},
      {"files",
       {{"resized.u8", {p.resized.height, p.resized.width, 3}},
        {"patches.f32", {p.plan.num_patches(), 3, c.vision.patch_size, c.vision.patch_size}},
        {"vit.f32", {p.plan.num_patches(), c.vision.dim}},
        {"aligner.f32", {p.plan.n_llm_h * p.plan.n_llm_w, c.dim}}}},
  };
  if (args.has("--json")) {
    std::printf("%s\n", plan.dump(2).c_str());
  } else {
    std::printf("%s: %lldx%lld -> %lldx%lld pixels (fitted %lldx%lld at %lld,%lld), ViT grid %lldx%lld, LLM grid "
                "%lldx%lld, span %lld tokens; wrote %s\n",
                image_path.c_str(), static_cast<long long>(rgb.width), static_cast<long long>(rgb.height),
                static_cast<long long>(p.plan.best_w), static_cast<long long>(p.plan.best_h),
                static_cast<long long>(p.fitted_w), static_cast<long long>(p.fitted_h),
                static_cast<long long>(p.pad_x), static_cast<long long>(p.pad_y),
                static_cast<long long>(p.plan.n_vit_h), static_cast<long long>(p.plan.n_vit_w),
                static_cast<long long>(p.plan.n_llm_h), static_cast<long long>(p.plan.n_llm_w),
                static_cast<long long>(p.plan.num_tokens), out.c_str());
  }
  return 0;
}

}  // namespace dsv41::cli
