// The compressor's pooling (model-spec §3.3 step 3), scalar reference: the `ratio` projected rows of
// one group become one latent row through a per-channel softmax gate over their scores, in fp32
// (torch's exp: torch_math.h).
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/reference.h"
#include "numeric/formats.h"
#include "kernels/torch_math.h"

namespace dsv41::reference {

void compressor_pool(const float* kv, const float* score, int64_t ratio, int64_t D, float* out) {
  for (int64_t ch = 0; ch < D; ++ch) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ratio; ++t) mx = std::max(mx, score[t * D + ch]);
    float sum = 0;
    for (int64_t t = 0; t < ratio; ++t) sum += torch_exp(score[t * D + ch] - mx);
    float acc = 0;
    for (int64_t t = 0; t < ratio; ++t) acc += kv[t * D + ch] * (torch_exp(score[t * D + ch] - mx) / sum);
    out[ch] = round_bf16(acc);
  }
}

}  // namespace dsv41::reference
