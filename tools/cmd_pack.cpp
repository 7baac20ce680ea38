// dsv41 pack: a checkpoint in the released layout from full-precision weights, e.g. those
// tools/train exports. The configuration and tokenizer come from a model folder of the same geometry
// (the one training started from); every tensor the layout needs must be in the weights file as F32
// with its logical shape, and nothing else may be: a missing, misshapen or unknown tensor is an error
// naming it. Quantization is the engine's own (the same code make-tiny writes with).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "cli.h"
#include "commands.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/checkpoint_writer.h"
#include "model/tensor_layout.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 pack --like DIR --weights FILE --out DIR [--shard-mb N]

  --like DIR       a model folder whose config.json and tokenizer.json the new checkpoint keeps
  --weights FILE   one safetensors file of F32 tensors named as in the checkpoint, without the
                   .scale tensors: quantized weights as [rows, in] (experts unpacked), others as stored
  --out DIR        where to write the checkpoint (config.json, inference/config.json, tokenizer.json,
                   shards and model.safetensors.index.json)
  --shard-mb N     shard size in MB (default 4)
)";

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

int run_pack(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("pack", argc, argv, {"--like", "--weights", "--out", "--shard-mb"}, {}, {{"-o", "--out"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string like = args.required("--like");
  const ModelConfig config = load_config(like);
  const std::string tokenizer_path = (std::filesystem::path(like) / "tokenizer.json").string();
  const nlohmann::json tokenizer = read_json_file(tokenizer_path);
  const std::string weights_path = args.required("--weights");
  const SafetensorsFile weights(weights_path);
  const uint64_t shard_bytes = static_cast<uint64_t>(args.get_int("--shard-mb", 4, 1, 1 << 20)) << 20;

  // Everything is checked before anything is written, so a bad file leaves no half-written folder.
  std::set<std::string> expected;
  for (const TensorSpec& s : checkpoint_tensors(config)) {
    if (s.kind == TensorKind::Scale) continue;
    expected.insert(s.name);
    const TensorView* t = weights.find(s.name);
    if (t == nullptr) fail(weights_path, "has no tensor " + s.name);
    const std::vector<int64_t> want = s.logical_in > 0 ? std::vector<int64_t>{s.shape[0], s.logical_in} : s.shape;
    if (t->dtype() != DType::F32 || t->shape() != want) {
      fail(weights_path, s.name + " must be F32 " + shape_text(want) + ", is " + dtype_name(t->dtype()) + " " +
                             shape_text(t->shape()));
    }
    const float* x = reinterpret_cast<const float*>(t->data);
    for (int64_t i = 0; i < t->numel(); ++i) {
      if (!std::isfinite(x[i])) fail(weights_path, s.name + " holds a value that is not finite");
    }
  }
  for (const TensorInfo& info : weights.infos()) {
    if (!expected.count(info.name)) fail(weights_path, "holds " + info.name + ", which the checkpoint layout has no place for");
  }
  write_checkpoint(args.required("--out"), config, tokenizer, shard_bytes, [&](const TensorSpec& s, int64_t count) {
    std::vector<float> v(static_cast<size_t>(count));
    std::memcpy(v.data(), weights.find(s.name)->data, v.size() * sizeof(float));
    return v;
  });
  std::fprintf(stderr, "%s: %zu tensors packed\n", args.required("--out").c_str(), expected.size());
  return 0;
}

}  // namespace dsv41::cli
