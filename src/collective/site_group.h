// SiteGroup: the workers of one site as a c10d process group (Gloo on CPU) over a TCPStore.
// Inside a site the network is fast, so this layer uses c10d as is, in full precision.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>

namespace nebula::collective {

class SiteGroup {
 public:
  // Rendezvous at the site's TCPStore `store_host:store_port`; local rank 0 hosts the store.
  // Blocks until all `size` ranks have joined or `timeout` passes (then throws nebula::Timeout).
  SiteGroup(const std::string& site, const std::string& store_host, uint16_t store_port, int rank, int size,
            std::chrono::milliseconds timeout);
  ~SiteGroup();
  SiteGroup(const SiteGroup&) = delete;
  SiteGroup& operator=(const SiteGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& site() const { return site_; }

  // In-place collectives over the site's ranks (contiguous CPU tensors). Each waits at most the
  // group's timeout and rethrows c10d's error as nebula::Error naming the site and operation.
  void allreduce_sum(at::Tensor& t);
  void reduce_sum_to_root(at::Tensor& t);
  void broadcast_from_root(at::Tensor& t);
  void barrier();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string site_;
  int rank_;
  int size_;
};

}  // namespace nebula::collective
