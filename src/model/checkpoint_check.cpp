#include "model/checkpoint_check.h"

#include <set>

#include "model/tensor_layout.h"
#include "util/error.h"

namespace dsv41 {

void check_checkpoint(const Checkpoint& checkpoint, const ModelConfig& config) {
  std::set<std::string> expected;
  for (const TensorSpec& spec : checkpoint_tensors(config)) {
    checkpoint.expect(spec.name, spec.dtype, spec.shape);
    expected.insert(spec.name);
  }
  for (const std::string& name : checkpoint.names()) {
    if (!expected.count(name) && !is_optional_tensor(name)) {
      fail(checkpoint.path(), "tensor " + name + " is not part of the model the config describes");
    }
  }
}

}  // namespace dsv41
