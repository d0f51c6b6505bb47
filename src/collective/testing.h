// Test helper: runs a whole multi-site job as threads of one process on loopback, one thread
// per worker, with ephemeral ports, like gloo's multi-rank test helpers. Every port is bound
// with port 0 by its owner and then handed to the others: no pick-then-bind window that a
// concurrent process (tests run in parallel) could fall into.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective/gateway_mesh.h"
#include "collective/hierarchical.h"
#include "collective/site_group.h"
#include "collective/worker_mesh.h"
#include "nebula/error.h"
#include "transport/site_connector.h"
#include "transport/tcp_link.h"

namespace nebula::collective::testing {

// The port of a group's TCPStore, published by its rank 0 once the store listens on a port of
// the kernel's choosing, to the other ranks' threads. Shared by the threads of one group.
class StorePort {
 public:
  StorePort() : future_(promise_.get_future().share()) {}
  void publish(uint16_t port) { settle([&] { promise_.set_value(port); }); }
  // Rank 0 failed before (or after) publishing: the others fail fast instead of waiting.
  void fail(std::exception_ptr e) { settle([&] { promise_.set_exception(e); }); }
  // Waits at most `timeout` for rank 0; rethrows rank 0's failure.
  uint16_t await(const std::string& group, std::chrono::milliseconds timeout) const {
    if (future_.wait_for(timeout) != std::future_status::ready)
      throw Timeout(group, "group " + group + ": rank 0 did not publish its store port within " +
                               std::to_string(timeout.count()) + " ms");
    return future_.get();
  }

 private:
  template <typename F>
  void settle(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    if (settled_) return;
    settled_ = true;
    f();
  }
  std::mutex mu_;
  bool settled_ = false;
  std::promise<uint16_t> promise_;
  std::shared_future<uint16_t> future_;
};

// Joins `group` on loopback: rank 0 hosts the store on port 0 and publishes the bound port through
// `port`; the other ranks wait (bounded by `timeout`) for it, then join. Every rank of the group
// must call this with the same `port`.
inline SiteGroup join_group(const std::string& group, int rank, int size, std::chrono::milliseconds timeout,
                            StorePort& port) {
  if (rank != 0) return SiteGroup(group, "127.0.0.1", port.await(group, timeout), rank, size, timeout);
  try {
    return SiteGroup(group, "127.0.0.1", 0, 0, size, timeout, [&](uint16_t p) { port.publish(p); });
  } catch (...) {
    port.fail(std::current_exception());
    throw;
  }
}

// One site of `size` workers, each a thread joined to group `name` on loopback, calling
// body(group) (group.rank() tells which). Ends with a barrier; rethrows the first exception
// of any thread after all have finished.
inline void run_site(const std::string& name, int size, const std::function<void(SiteGroup&)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  StorePort port;
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        SiteGroup group = join_group(name, r, size, timeout, port);
        body(group);
        group.barrier();
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

struct Rank {
  size_t site;
  int local_rank;
  int global_rank;
  int world_size;
  Hierarchy* hierarchy;
};

// Builds sites with workers_per_site[i] workers each and calls body(rank) on every worker's
// thread. Rethrows the first exception of any thread after all have finished. `every_worker`:
// each worker links to every worker of the other sites (wan.mode = "every_worker"), and the
// gateways' mesh runs over rank 0's links to the other rank 0s, as site/site_comm.cc builds it.
inline void run_cluster(const std::vector<int>& workers_per_site, const std::function<void(Rank&)>& body,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60), bool every_worker = false) {
  const size_t n = workers_per_site.size();
  std::vector<std::string> names;
  std::vector<transport::SiteAddress> endpoints;  // the gateways, or every worker
  std::vector<WorkerSlot> slots;
  std::vector<std::unique_ptr<transport::TcpListener>> listeners;
  std::vector<StorePort> store_ports(n);
  for (size_t s = 0; s < n; ++s) {
    names.push_back("site" + std::to_string(s));
    for (int r = 0; r < (every_worker ? workers_per_site[s] : 1); ++r) {
      listeners.push_back(std::make_unique<transport::TcpListener>("127.0.0.1", 0));
      const std::string address = "127.0.0.1:" + std::to_string(listeners.back()->port());
      if (every_worker) {
        endpoints.push_back({names[s] + "/" + std::to_string(r), address, names[s]});
        slots.push_back({s, r, endpoints.back().name});
      } else {
        endpoints.push_back({names[s], address, ""});
      }
    }
  }
  int world = 0;
  for (int w : workers_per_site) world += w;
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  int global = 0;
  size_t endpoint = 0;
  for (size_t s = 0; s < n; ++s) {
    for (int r = 0; r < workers_per_site[s]; ++r, ++global) {
      const size_t self = every_worker ? endpoint++ : s;
      threads.emplace_back([&, s, r, global, self] {
        try {
          SiteGroup group = join_group(names[s], r, workers_per_site[s], timeout, store_ports[s]);
          std::unique_ptr<SiteGroup> comm_group = every_worker ? group.fork("comm") : nullptr;
          std::unique_ptr<transport::SiteConnector> connector;
          std::unique_ptr<WorkerMesh> workers;
          std::unique_ptr<GatewayMesh> mesh;
          if (r == 0 || every_worker) {
            // Plaintext, unemulated links: this helper tests the collectives, not the WAN.
            transport::ConnectorOptions o;
            o.job = "test";
            o.self = self;
            o.sites = endpoints;
            o.reconnect_timeout = timeout;
            connector = std::make_unique<transport::SiteConnector>(std::move(o), std::move(listeners[self]));
            auto links = connector->connect_all(Deadline::after(timeout));
            if (every_worker) {
              workers = std::make_unique<WorkerMesh>(
                  self, slots,
                  std::vector<std::shared_ptr<transport::Link>>(std::make_move_iterator(links.begin()),
                                                                std::make_move_iterator(links.end())),
                  timeout);
              if (r == 0) {
                std::vector<std::shared_ptr<transport::Link>> gateways(n);
                for (size_t j = 0; j < n; ++j)
                  if (j != s) gateways[j] = workers->link(workers->slot(j, 0));
                mesh = std::make_unique<GatewayMesh>(MeshOptions{s, names, timeout}, std::move(gateways));
              }
            } else {
              mesh = std::make_unique<GatewayMesh>(MeshOptions{s, names, timeout}, std::move(links));
            }
          }
          Hierarchy h(group, mesh.get(), workers.get(), comm_group.get());
          Rank rank{s, r, global, world, &h};
          body(rank);
          group.barrier();  // keep the links alive until the site is done with them
        } catch (...) {
          errors[global] = std::current_exception();
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace nebula::collective::testing
