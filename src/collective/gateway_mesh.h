// GatewayMesh: the inter-site leg. Each site's gateway (local rank 0) holds one Link to every
// other site's gateway (a full mesh: site i dials every site j < i and accepts from every j > i),
// and exchanges byte payloads with them in lock step, one operation id per exchange.
//
// The mesh never names a socket type: it is handed a dial and an accept function that return
// Links (TCP today; TLS, striping and WAN emulation wrap or replace them without touching this).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nebula/deadline.h"
#include "transport/link.h"

namespace nebula::collective {

struct MeshOptions {
  std::string job;                      // both ends must agree, or the hello is refused
  size_t site_index = 0;                // this gateway's site
  std::vector<std::string> site_names;  // every site, in config order
  std::vector<std::string> addresses;   // gateway "host:port" of every site (own entry unused)
  std::chrono::milliseconds timeout{60000};  // for connecting and for every exchange
};

// dial(address, peer_site, deadline) and accept(deadline) make one connected Link each.
using DialFn = std::function<std::unique_ptr<transport::Link>(const std::string&, const std::string&, Deadline)>;
using AcceptFn = std::function<std::unique_ptr<transport::Link>(Deadline)>;

class GatewayMesh {
 public:
  // Connects to every other site (blocking until all are connected or the timeout passes).
  GatewayMesh(MeshOptions options, const DialFn& dial, const AcceptFn& accept);
  ~GatewayMesh();

  size_t num_sites() const { return options_.site_names.size(); }
  size_t site_index() const { return options_.site_index; }

  // Sends `payload` to every other site and returns every site's payload, indexed by site
  // (this site's own is moved into its slot). All gateways must call it in the same order;
  // a frame with another operation id is a protocol error naming both ids and the peer.
  // Throws PeerLost / Timeout naming the peer.
  std::vector<std::vector<uint8_t>> all_gather(std::vector<uint8_t> payload);

  // Total bytes (headers included) over all of this gateway's links.
  uint64_t bytes_sent() const;
  uint64_t bytes_received() const;

  void close();

 private:
  MeshOptions options_;
  std::vector<std::unique_ptr<transport::Link>> links_;  // indexed by site; null for self
  uint64_t next_op_ = 1;  // owned by the single thread that calls all_gather
};

}  // namespace nebula::collective
