// Test helper: runs a whole multi-site job as threads of one process on loopback, one thread
// per worker, with ephemeral ports, like gloo's multi-rank test helpers.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective/gateway_mesh.h"
#include "collective/hierarchical.h"
#include "collective/site_group.h"
#include "transport/site_connector.h"
#include "transport/tcp_link.h"

namespace nebula::collective::testing {

struct Rank {
  size_t site;
  int local_rank;
  int global_rank;
  int world_size;
  Hierarchy* hierarchy;
};

// Builds sites with workers_per_site[i] workers each and calls body(rank) on every worker's
// thread. Rethrows the first exception of any thread after all have finished.
inline void run_cluster(const std::vector<int>& workers_per_site, const std::function<void(Rank&)>& body,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const size_t n = workers_per_site.size();
  std::vector<std::string> names, addresses;
  std::vector<std::unique_ptr<transport::TcpListener>> listeners;
  std::vector<uint16_t> store_ports;
  for (size_t s = 0; s < n; ++s) {
    names.push_back("site" + std::to_string(s));
    listeners.push_back(std::make_unique<transport::TcpListener>("127.0.0.1", 0));
    addresses.push_back("127.0.0.1:" + std::to_string(listeners.back()->port()));
    store_ports.push_back(transport::pick_free_port("127.0.0.1"));
  }
  int world = 0;
  for (int w : workers_per_site) world += w;
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  int global = 0;
  for (size_t s = 0; s < n; ++s) {
    for (int r = 0; r < workers_per_site[s]; ++r, ++global) {
      threads.emplace_back([&, s, r, global] {
        try {
          SiteGroup group(names[s], "127.0.0.1", store_ports[s], r, workers_per_site[s], timeout);
          std::unique_ptr<transport::SiteConnector> connector;
          std::unique_ptr<GatewayMesh> mesh;
          if (r == 0) {
            // Plaintext, unemulated links: this helper tests the collectives, not the WAN.
            transport::ConnectorOptions o;
            o.job = "test";
            o.self = s;
            for (size_t j = 0; j < n; ++j) o.sites.push_back({names[j], addresses[j]});
            o.reconnect_timeout = timeout;
            connector = std::make_unique<transport::SiteConnector>(std::move(o), std::move(listeners[s]));
            mesh = std::make_unique<GatewayMesh>(MeshOptions{s, names, timeout},
                                                 connector->connect_all(Deadline::after(timeout)));
          }
          Hierarchy h(group, mesh.get());
          Rank rank{s, r, global, world, &h};
          body(rank);
          group.barrier();  // keep the gateway alive until its site is done with it
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
