#include "python/process_group.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "nebula/error.h"

namespace nebula::python {
namespace {

// A collective that already ran: wait() returns at once, the future holds its result.
class FinishedWork : public c10d::Work {
 public:
  FinishedWork(c10d::OpType type, std::vector<at::Tensor> result) : c10d::Work(-1, type) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(std::move(result)));
    finish();
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

c10::intrusive_ptr<c10d::Work> finished(c10d::OpType type, std::vector<at::Tensor> result) {
  return c10::make_intrusive<FinishedWork>(type, std::move(result));
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "nebula backend: ", op, " on a ", t.device(),
              " tensor: only CPU tensors so far (move it to the CPU, or use Gloo/NCCL inside a site)");
  TORCH_CHECK(t.is_contiguous(), "nebula backend: ", op, " needs a contiguous tensor, got one of strides ",
              t.strides());
}

const char* op_name(c10d::ReduceOp op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    default: return "this reduce op";
  }
}

// SUM (any dtype) or AVG (float32) over every worker of every site, in place, exactly: a
// collective carries whatever the caller reduces (metric sums, counters, loss averages), so no
// codec touches it. Compression for DDP's gradients belongs in a communication hook.
void reduce_in_place(Session& s, at::Tensor& t, c10d::ReduceOp op, const char* what) {
  if (op == c10d::ReduceOp::SUM) {
    s.allreduce_sum(t);
  } else if (op == c10d::ReduceOp::AVG) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "nebula backend: ", what, " with AVG needs float32, got ",
                t.scalar_type(), " (use SUM)");
    s.allreduce(t, 1.0);
  } else {
    TORCH_CHECK(false, "nebula backend: ", what, " with ", op_name(op), " is not supported (SUM and AVG are)");
  }
}

}  // namespace

ProcessGroupNebula::ProcessGroupNebula(std::shared_ptr<Session> session)
    : BackendBase(session->global_rank(), session->world_size()), session_(std::move(session)) {
  // Every collective is exact (reduce_in_place): [strategy] codec does not apply to them.
  const Config& c = session_->config();
  if (c.strategy.kind == "sync" && c.strategy.codec != "none" && session_->global_rank() == 0)
    spdlog::warn("{}: strategy.codec = \"{}\" is not applied to torch.distributed collectives (they are exact, a "
                 "user's own sums included); to compress over the WAN use nebula.DiLoCo", c.source_path,
                 c.strategy.codec);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  for (auto& t : tensors) {
    check_tensor(t, "all_reduce");
    reduce_in_place(*session_, t, opts.reduceOp, "all_reduce");
  }
  ++sequence_;
  return finished(c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  for (auto& t : tensors) {
    check_tensor(t, "broadcast");
    session_->broadcast(t, static_cast<int>(opts.rootRank));
  }
  ++sequence_;
  return finished(c10d::OpType::BROADCAST, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions&) {
  TORCH_CHECK(outputs.size() == inputs.size(), "nebula backend: all_gather with ", inputs.size(), " inputs and ",
              outputs.size(), " output lists");
  std::vector<at::Tensor> result;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "all_gather");
    TORCH_CHECK(outputs[i].size() == static_cast<size_t>(getSize()), "nebula backend: all_gather into ",
                outputs[i].size(), " tensors; the job has ", getSize(), " ranks");
    std::vector<at::Tensor> all = session_->allgather(inputs[i]);
    for (size_t r = 0; r < all.size(); ++r) {
      TORCH_CHECK(all[r].numel() == outputs[i][r].numel(), "nebula backend: all_gather: rank ", r, " sent ",
                  all[r].numel(), " values, the output for it holds ", outputs[i][r].numel());
      outputs[i][r].copy_(all[r].view(outputs[i][r].sizes()));
      result.push_back(outputs[i][r]);
    }
  }
  ++sequence_;
  return finished(c10d::OpType::ALLGATHER, result);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions&) {
  check_tensor(input, "all_gather_into_tensor");
  check_tensor(output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "nebula backend: all_gather_into_tensor of ",
              input.numel(), " values per rank into ", output.numel(), " (want ", input.numel() * getSize(), ")");
  std::vector<at::Tensor> all = session_->allgather(input);
  at::Tensor flat = output.view({-1});
  for (size_t r = 0; r < all.size(); ++r)
    flat.narrow(0, static_cast<int64_t>(r) * input.numel(), input.numel()).copy_(all[r].view({-1}));
  ++sequence_;
  return finished(c10d::OpType::_ALLGATHER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "nebula backend: reduce_scatter with ", inputs.size(),
              " input lists and ", outputs.size(), " outputs");
  for (size_t i = 0; i < outputs.size(); ++i) {
    check_tensor(outputs[i], "reduce_scatter");
    TORCH_CHECK(inputs[i].size() == static_cast<size_t>(getSize()), "nebula backend: reduce_scatter of ",
                inputs[i].size(), " tensors; the job has ", getSize(), " ranks");
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[i]) flat.push_back(t.reshape({-1}));
    at::Tensor whole = at::cat(flat);
    reduce_in_place(*session_, whole, opts.reduceOp, "reduce_scatter");
    int64_t at = 0;
    for (int r = 0; r < getRank(); ++r) at += inputs[i][static_cast<size_t>(r)].numel();
    TORCH_CHECK(outputs[i].numel() == inputs[i][static_cast<size_t>(getRank())].numel(),
                "nebula backend: reduce_scatter: the output holds ", outputs[i].numel(), " values, this rank's input ",
                inputs[i][static_cast<size_t>(getRank())].numel());
    outputs[i].copy_(whole.narrow(0, at, outputs[i].numel()).view(outputs[i].sizes()));
  }
  ++sequence_;
  return finished(c10d::OpType::REDUCE_SCATTER, outputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  check_tensor(input, "reduce_scatter_tensor");
  check_tensor(output, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "nebula backend: reduce_scatter_tensor of ", input.numel(),
              " values into ", output.numel(), " per rank (want ", output.numel() * getSize(), ")");
  at::Tensor whole = input.reshape({-1}).clone();
  reduce_in_place(*session_, whole, opts.reduceOp, "reduce_scatter_tensor");
  output.copy_(whole.narrow(0, getRank() * output.numel(), output.numel()).view(output.sizes()));
  ++sequence_;
  return finished(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNebula::barrier(const c10d::BarrierOptions&) {
  session_->barrier();
  ++sequence_;
  return finished(c10d::OpType::BARRIER, {});
}

}  // namespace nebula::python
