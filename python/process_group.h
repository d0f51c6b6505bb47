// The torch.distributed backend "nebula" (docs/python.md): a c10d process group over a
// nebula::Session, so torch.distributed calls and DistributedDataParallel run across every
// worker of every site — inside a site through c10d Gloo, between sites through the gateways'
// mutually authenticated WAN links.
//
//   all_reduce     SUM on any dtype, AVG on float32 (Session::allreduce_sum / allreduce), exact
//                  whatever [strategy] codec says: a collective may carry a user's own sums
//   broadcast      from any rank, any dtype (Session::broadcast(t, root))
//   all_gather     any dtype (Session::allgather); also all_gather_into_tensor
//   reduce_scatter SUM / AVG: an all-reduce of the whole input, then this rank's part
//   barrier        every worker of every site
// Anything else (reduce, gather, scatter, all_to_all, send/recv, MIN/MAX/PRODUCT) raises an
// error naming the operation: c10d's default for a backend that lacks it.
//
// Every operation runs to completion on the calling thread and returns a finished Work whose
// future holds the result (DDP reads it). Tensors must be contiguous CPU tensors (CUDA ones:
// not yet; the error says so). Only the default group: a sub-group (new_group) is refused.
#pragma once

#include <memory>

#include "nebula/session.h"
#include "python/torch_compat.h"

namespace nebula::python {

class ProcessGroupNebula : public BackendBase {
 public:
  explicit ProcessGroupNebula(std::shared_ptr<Session> session);

  const std::string getBackendName() const override { return "nebula"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // DDP's logger asks; the count of collectives this group ran.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_; }

  Session& session() { return *session_; }

 private:
  std::shared_ptr<Session> session_;
  uint64_t sequence_ = 0;
};

}  // namespace nebula::python
