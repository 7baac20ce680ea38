// The other ranks of an expert-parallel job, as the forward pass of the leading rank (rank 0, the one
// that runs the scheduler) sees them: the owners of the routed experts and Engram rows it does not
// hold. The model knows only this interface; parallel/ implements it over MPI. Calls come from one
// thread at a time (the thread running the forward) and in the order a forward makes them.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "model/expert_share.h"

namespace dsv41 {

class ExpertPeers {
 public:
  virtual ~ExpertPeers() = default;
  // What the leading rank holds itself.
  virtual const ExpertShare& share() const = 0;

  // One MoE layer's remote part, in two calls so the leading rank computes its own experts between
  // them. `dispatch` sends the routing (experts and weights [tokens, k]) to every rank and to each
  // owner the rows of x [tokens, dim] its experts need; `combine` receives the owners' outputs into
  // `routed` (one row per entry of `d`, in dispatch order; the rows of experts held here are left as
  // they are). A `dispatch` must be followed by its `combine`, also when the work between them fails.
  virtual void dispatch(int layer, const float* x, int64_t tokens, int64_t dim, const int32_t* experts,
                        const float* weights, int64_t k, const MoeDispatch& d) = 0;
  virtual void combine(int layer, const MoeDispatch& d, int64_t dim, float* routed) = 0;

  // The Engram rows of `ids` (table `slot`, of `table_rows` rows) that other ranks hold, written
  // into codes [ids, row_bytes] and scales [ids, scale_bytes] at the positions of those ids; the
  // positions of rows held here are left as they are.
  virtual void engram_rows(int slot, const std::vector<int64_t>& ids, int64_t table_rows, int64_t row_bytes,
                           int64_t scale_bytes, uint8_t* codes, uint8_t* scales) = 0;
};

}  // namespace dsv41
