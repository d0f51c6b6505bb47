#include "collective/hierarchical.h"

#include <ATen/ATen.h>

#include <cstring>

#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::collective {

Hierarchy::Hierarchy(SiteGroup& site, GatewayMesh* mesh) : site_(site), mesh_(mesh) {
  NEBULA_CHECK((site.rank() == 0) == (mesh != nullptr), "site ", site.site(), " rank ", site.rank(),
               ": the gateway mesh belongs to local rank 0 only");
}

void Work::wait(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline.at(), [&] { return done_; }))
    throw Timeout("", str_cat(what_, ": still running at its deadline"));
  if (error_) std::rethrow_exception(error_);
}

bool Work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Work::finish(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = true;
  error_ = error;
  cv_.notify_all();
}

Hierarchy::~Hierarchy() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (comm_thread_.joinable()) comm_thread_.join();
}

void Hierarchy::comm_main() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

std::shared_ptr<Work> Hierarchy::allreduce_async(std::vector<at::Tensor> bucket, AllreduceOptions options) {
  auto work = std::make_shared<Work>();
  work->what_ = str_cat("site ", site_.site(), ": all-reduce of bucket ", options.tag);
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    NEBULA_CHECK(!stopping_, "collective queued on a hierarchy that is shutting down");
    if (!comm_thread_.joinable()) comm_thread_ = std::thread([this] { comm_main(); });
    queue_.push_back([this, bucket = std::move(bucket), options, work] {
      try {
        run_allreduce(bucket, options);
        work->finish(nullptr);
      } catch (...) {
        work->finish(std::current_exception());
      }
    });
  }
  queue_cv_.notify_one();
  return work;
}

void Hierarchy::allreduce(at::Tensor& t, const AllreduceOptions& options) { allreduce(std::vector<at::Tensor>{t}, options); }

void Hierarchy::allreduce(const std::vector<at::Tensor>& bucket, const AllreduceOptions& options) {
  // Through the queue, so synchronous and asynchronous calls can never interleave.
  allreduce_async(bucket, options)->wait(Deadline::never());
}

void Hierarchy::run_allreduce(const std::vector<at::Tensor>& bucket, const AllreduceOptions& options) {
  int64_t n = 0;
  for (const auto& t : bucket) {
    NEBULA_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                 "hierarchical allreduce needs contiguous float32 CPU tensors, got ", t.toString());
    n += t.numel();
  }
  NEBULA_CHECK(options.weight >= 0, "weight ", options.weight);
  ++allreduces_;
  const bool weighted = options.op == ReduceOp::kWeightedMean;

  // One buffer: the (weighted) values, then the weight, reduced together inside the site
  // (float32 is exact for weights up to 2^24); across sites the weight travels as float64.
  at::Tensor buf = at::empty({n + 1}, at::kFloat);
  int64_t offset = 0;
  for (const auto& t : bucket) {
    buf.narrow(0, offset, t.numel()).copy_(t.reshape({-1}));
    offset += t.numel();
  }
  if (weighted) buf.narrow(0, 0, n).mul_(options.weight);
  buf[n] = static_cast<float>(weighted ? options.weight : 1.0);
  site_.reduce_sum_to_root(buf);

  if (mesh_) {
    // What this site contributes: its (weighted) sum, encoded once, and its total weight.
    // The parts: each tensor (per_tensor) or the whole bucket as one flat vector.
    const float* p = buf.data_ptr<float>();
    const double site_weight = p[n];
    std::vector<at::Tensor> parts;
    offset = 0;
    if (options.codec && options.per_tensor) {
      for (const auto& t : bucket) {
        parts.push_back(buf.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    } else {
      parts.push_back(buf.narrow(0, 0, n));
    }
    wire::ByteWriter w;
    w.put_u64(static_cast<uint64_t>(n));
    w.put_f64(site_weight);
    w.put_u8(options.codec ? 1 : 0);
    w.put_u32(static_cast<uint32_t>(parts.size()));
    for (size_t i = 0; i < parts.size(); ++i) {
      if (options.codec) {
        auto start = Clock::now();
        auto encoded = options.codec->encode(parts[i], codec_state_[{options.tag, i}]);
        encode_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
        codec_bytes_out_ += encoded.size();
        w.put_u64(encoded.size());
        w.put_bytes(encoded);
      } else {
        w.put_u64(static_cast<uint64_t>(n) * sizeof(float));
        w.put_bytes({reinterpret_cast<const uint8_t*>(p), static_cast<size_t>(n) * sizeof(float)});
        codec_bytes_out_ += static_cast<uint64_t>(n) * sizeof(float);
      }
    }
    codec_bytes_in_ += static_cast<uint64_t>(n) * sizeof(float);
    auto all = mesh_->all_gather(w.take());

    // Every gateway decodes the same bytes (its own included) and adds them in site order, so
    // all sites compute exactly the same floats.
    at::Tensor sum = at::zeros({n}, at::kFloat);
    double total_weight = 0;
    for (size_t s = 0; s < all.size(); ++s) {
      wire::ByteReader r(all[s], "allreduce payload from site " + std::to_string(s));
      uint64_t count = r.u64();
      if (count != static_cast<uint64_t>(n))
        throw Error(str_cat("allreduce: site ", s, " sent ", count, " elements, this site has ", n,
                            ": the sites' models differ"));
      total_weight += r.f64();
      const bool coded = r.u8() != 0;
      const uint32_t nparts = r.u32();
      if (coded != (options.codec != nullptr) || nparts != parts.size())
        throw Error(str_cat("allreduce: site ", s, " sent ", nparts, (coded ? " encoded" : " raw"), " part(s), this site ",
                            parts.size(), (options.codec ? " encoded" : " raw"),
                            ": the sites' [strategy] codec settings differ"));
      int64_t at = 0;
      for (uint32_t i = 0; i < nparts; ++i) {
        const int64_t numel = parts[i].numel();
        auto bytes = r.bytes(static_cast<size_t>(r.u64()));
        at::Tensor target = sum.narrow(0, at, numel);
        if (coded) {
          auto start = Clock::now();
          target.add_(options.codec->decode(bytes, numel).reshape({-1}));
          decode_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
        } else {
          if (bytes.size() != static_cast<size_t>(numel) * sizeof(float))
            throw Error(str_cat("allreduce: site ", s, " sent ", bytes.size(), " bytes for ", numel, " floats"));
          at::Tensor part = at::empty({numel}, at::kFloat);
          if (numel) std::memcpy(part.data_ptr<float>(), bytes.data(), bytes.size());
          target.add_(part);
        }
        at += numel;
      }
      r.expect_done();
    }
    if (weighted) {
      NEBULA_CHECK(total_weight > 0, "weighted allreduce with total weight ", total_weight);
      sum.div_(total_weight);
    }
    buf.narrow(0, 0, n).copy_(sum);
  }
  site_.broadcast_from_root(buf);
  offset = 0;
  for (const auto& t : bucket) {
    t.view({-1}).copy_(buf.narrow(0, offset, t.numel()));
    offset += t.numel();
  }
}

void Hierarchy::broadcast_from_first(at::Tensor& t) {
  // A weighted mean where only global rank 0 has weight: exact (x·1 + 0)/1 = x.
  const bool first = mesh_ && mesh_->site_index() == 0;  // the mesh lives on local rank 0 only
  AllreduceOptions o;
  o.op = ReduceOp::kWeightedMean;
  o.weight = first ? 1.0 : 0.0;
  allreduce(t, o);
}

CommStats Hierarchy::stats() const {
  CommStats s;
  s.allreduces = allreduces_;
  if (mesh_) {
    s.wan_bytes_sent = mesh_->bytes_sent();
    s.wan_bytes_received = mesh_->bytes_received();
    s.links = mesh_->estimates();
    s.codec_bytes_in = codec_bytes_in_;
    s.codec_bytes_out = codec_bytes_out_;
    s.encode_seconds = encode_seconds_;
    s.decode_seconds = decode_seconds_;
  }
  return s;
}

}  // namespace nebula::collective
