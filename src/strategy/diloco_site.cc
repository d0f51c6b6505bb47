// DilocoStrategy inside the site: the site's data parallel step (the weighted gradient average,
// every step, with the buffers beside it) and ZeRO's sharded outer state (set_sharding).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x

#include "nebula/error.h"
#include "strategy/diloco.h"

namespace nebula::strategy {

void DilocoStrategy::sync_gradients(const std::vector<at::Tensor>& params, double weight) {
  NEBULA_CHECK(params.size() == params_.size(), "sync_gradients with ", params.size(), " parameters, init had ",
               params_.size());
  collective::SiteGroup& site = data_group();  // a pipeline stage: its replicas
  if (site.size() == 1) {  // nothing to average; the weight still counts for the exchange
    site_weight_ += weight;
    return;
  }
  at::NoGradGuard no_grad;
  // The weight and the weighted buffers (as forward left them this step) travel beside the
  // gradients as a tail [w, b·w]; summed, it gives the site's total weight and buffer mean.
  auto pack_tail = [&](at::Tensor tail) {
    tail[0] = static_cast<float>(weight);
    if (buffer_numel_ > 0) tail.narrow(0, 1, buffer_numel_).copy_(flatten(buffers_)).mul_(weight);
  };
  auto unpack_tail = [&](const at::Tensor& tail) {
    const double total = tail[0].item<double>();
    NEBULA_CHECK(total > 0, "site ", site.site(), ": total weight ", total, " in a data parallel step");
    site_weight_ += total;
    if (buffer_numel_ > 0) unflatten_into(tail.narrow(0, 1, buffer_numel_).div(total), buffers_);
    return total;
  };
  if (flat_grad_.defined()) {
    // ZeRO-2/3: the weighted gradients were reduce-scattered in backward (ZeRO-2's buckets,
    // ZeRO-3's layers), so this worker's shard holds the site's sum; the tail is all-reduced
    // and the sum becomes the average. No parameter's .grad holds anything.
    at::Tensor tail = at::empty({1 + buffer_numel_}, at::kFloat);
    pack_tail(tail);
    site.allreduce_sum(tail);
    flat_grad_.div_(unpack_tail(tail));
    return;
  }
  // Every step: the weighted gradients and the tail go straight into one buffer (no
  // intermediate flat copy), one all-reduce, and straight back.
  const int64_t n = held_numel();  // the site's whole model, or this worker's stage
  at::Tensor buf = at::empty({n + 1 + buffer_numel_}, at::kFloat);
  int64_t offset = 0;
  for (const auto& p : params) {
    at::Tensor slice = buf.narrow(0, offset, p.numel());
    if (p.grad().defined())
      slice.copy_(p.grad().reshape({-1})).mul_(weight);
    else
      slice.zero_();
    offset += p.numel();
  }
  pack_tail(buf.narrow(0, n, 1 + buffer_numel_));
  site.allreduce_sum(buf);
  buf.narrow(0, 0, n).div_(unpack_tail(buf.narrow(0, n, 1 + buffer_numel_)));
  offset = 0;
  for (auto& p : params_) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    p.mutable_grad().copy_(buf.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
}

void DilocoStrategy::set_sharding(const Sharding& shards) {
  collective::SiteGroup& site = data_group();  // a pipeline stage: ZeRO over its replicas
  const int64_t n = site.size();
  NEBULA_CHECK(n > 1 && !fragments_.empty() && shard_numel_ == 0 && can_save(),
               "set_sharding: once, after init() and before the first step, on a site of more than one worker");
  const int64_t shards_held = shards.gathered ? n : 1;  // ZeRO-3: this worker's only
  const int64_t held = held_numel();  // the values this worker's group shards: the model's, or its stage's
  // A stage's replicas shard its values as a site shards the model's (StageLayout's pieces).
  const parallel::ShardLayout layout = staged() ? parallel::ShardLayout::contiguous(held, n) : site_layout(n);
  const int64_t shard = layout.shard_numel();
  auto check = [&](const at::Tensor& flat, const char* what) {
    NEBULA_CHECK(flat.numel() == shard * shards_held && flat.scalar_type() == at::kFloat && flat.is_contiguous() &&
                     flat.dim() == 1,
                 "set_sharding: ", flat.numel(), " ", what, " for ", held, " parameters over ", n,
                 " workers (want ", shards.gathered ? "N equal shards" : "one of N equal shards", " of ", shard,
                 " values: the site's layout, 1-D float32, contiguous)");
  };
  NEBULA_CHECK(shards.gathered == layout.is_contiguous(), "set_sharding: ",
               shards.gathered ? "whole parameters (ZeRO-1/2) with ZeRO-3's units" : "ZeRO-3's shards without its units",
               " (set_unit_bounds before init(), exactly with shard = \"full\")");
  check(shards.params, "parameter values");
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size() && shards.gathered; ++i) {
    NEBULA_CHECK(params_[i].numel() == 0 || params_[i].data_ptr() == shards.params.narrow(0, offset, 1).data_ptr(),
                 "set_sharding: parameter #", i, " is not the flat buffer's values from ", offset);
    offset += params_[i].numel();
  }
  if (shards.grads.defined()) {
    NEBULA_CHECK(shards.grads.numel() == shard && shards.grads.scalar_type() == at::kFloat && shards.grads.is_contiguous(),
                 "set_sharding: ", shards.grads.numel(), " gradient values for ", held, " parameters over ", n,
                 " workers (want this worker's ", shard, ": ZeRO-2/3 reduce-scatter them in backward)");
    flat_grad_ = shards.grads;
  }
  flat_params_ = shards.params;
  gathered_ = shards.gathered;
  shard_numel_ = shard;
  parted_ = true;
  // This worker's part of each fragment: its runs of the fragment in the site's layout.
  at::NoGradGuard no_grad;
  for (Fragment& fr : fragments_) {
    fr.part = site_parts(fr).at(static_cast<size_t>(comm_.site().rank()));
    fr.part_len = counts_of({fr.part})[0];
    if (expect_sharding_) {  // init() made the part already
      NEBULA_CHECK(fr.global.numel() == fr.part_len, "set_sharding: init() cut a part of ", fr.global.numel(),
                   " values, the shards give ", fr.part_len);
    } else {  // this worker's part of the whole state init() made
      fr.global = take_part(fr, fr.global);
      fr.momentum = take_part(fr, fr.momentum);
    }
  }
}

}  // namespace nebula::strategy
