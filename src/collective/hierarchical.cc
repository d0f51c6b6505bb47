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

void Hierarchy::allreduce(at::Tensor& t, const AllreduceOptions& options) {
  NEBULA_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
               "hierarchical allreduce needs a contiguous float32 CPU tensor, got ", t.toString());
  NEBULA_CHECK(options.weight >= 0, "weight ", options.weight);
  ++allreduces_;
  const bool weighted = options.op == ReduceOp::kWeightedMean;
  const int64_t n = t.numel();

  // One buffer: the (weighted) values, then the weight, reduced together inside the site
  // (float32 is exact for weights up to 2^24); across sites the weight travels as float64.
  at::Tensor buf = at::empty({n + 1}, at::kFloat);
  if (weighted) buf.narrow(0, 0, n).copy_(t.reshape({-1})).mul_(options.weight);
  else buf.narrow(0, 0, n).copy_(t.reshape({-1}));
  buf[n] = static_cast<float>(weighted ? options.weight : 1.0);
  site_.reduce_sum_to_root(buf);

  if (mesh_) {
    // What this site contributes: its (weighted) sum, encoded once, and its total weight.
    const float* p = buf.data_ptr<float>();
    const double site_weight = p[n];
    at::Tensor site_sum = buf.narrow(0, 0, n);
    wire::ByteWriter w;
    w.put_u64(static_cast<uint64_t>(n));
    w.put_f64(site_weight);
    w.put_u8(options.codec ? 1 : 0);
    if (options.codec) {
      auto start = Clock::now();
      // In the tensor's own shape: PowerSGD needs the matrix, the others do not mind.
      auto encoded = options.codec->encode(site_sum.view(t.sizes()), codec_state_[options.tag]);
      encode_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
      codec_bytes_out_ += encoded.size();
      w.put_bytes(encoded);
    } else {
      w.put_bytes({reinterpret_cast<const uint8_t*>(p), static_cast<size_t>(n) * sizeof(float)});
      codec_bytes_out_ += static_cast<uint64_t>(n) * sizeof(float);
    }
    codec_bytes_in_ += static_cast<uint64_t>(n) * sizeof(float);
    auto all = mesh_->all_gather(w.take());

    // Every gateway decodes the same bytes (its own included) and adds them in site order, so
    // all sites compute exactly the same floats.
    at::Tensor sum = at::zeros({n}, at::kFloat);
    double total_weight = 0;
    for (size_t s = 0; s < all.size(); ++s) {
      const std::string what = "allreduce payload from site " + std::to_string(s);
      wire::ByteReader r(all[s], what);
      uint64_t count = r.u64();
      if (count != static_cast<uint64_t>(n))
        throw Error(str_cat("allreduce: site ", s, " sent ", count, " elements, this site has ", n,
                            ": the sites' models differ"));
      total_weight += r.f64();
      const bool coded = r.u8() != 0;
      if (coded != (options.codec != nullptr))
        throw Error(str_cat("allreduce: site ", s, (coded ? " encodes" : " does not encode"),
                            " its contribution and this site ", (coded ? "does not" : "does"),
                            ": the sites' [strategy] codec settings differ"));
      if (coded) {
        auto bytes = r.bytes(r.remaining());
        auto start = Clock::now();
        sum.add_(options.codec->decode(bytes, n).reshape({-1}));
        decode_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
      } else {
        auto bytes = r.bytes(static_cast<size_t>(n) * sizeof(float));
        r.expect_done();
        at::Tensor part = at::empty({n}, at::kFloat);
        if (n) std::memcpy(part.data_ptr<float>(), bytes.data(), bytes.size());
        sum.add_(part);
      }
    }
    if (weighted) {
      NEBULA_CHECK(total_weight > 0, "weighted allreduce with total weight ", total_weight);
      sum.div_(total_weight);
    }
    buf.narrow(0, 0, n).copy_(sum);
  }
  site_.broadcast_from_root(buf);
  t.view({-1}).copy_(buf.narrow(0, 0, n));
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
