#include "collective/gateway_mesh.h"

#include <spdlog/spdlog.h>

#include <future>

#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::collective {
namespace {

constexpr uint32_t kMeshProtocol = 1;

std::vector<uint8_t> hello_payload(const std::string& job, const std::string& from, const std::string& to) {
  wire::ByteWriter w;
  w.put_u32(kMeshProtocol);
  w.put_string(job);
  w.put_string(from);
  w.put_string(to);
  return w.take();
}

struct Hello {
  uint32_t protocol;
  std::string job, from, to;
};

Hello read_hello(const wire::Frame& f, const std::string& peer) {
  if (f.header.type != wire::FrameType::kHello)
    throw Error(str_cat("gateway handshake with ", peer, ": expected a hello frame, got type ",
                        static_cast<int>(f.header.type)));
  wire::ByteReader r(f.payload, "hello from " + peer);
  Hello h;
  h.protocol = r.u32();
  h.job = r.string(256);
  h.from = r.string(256);
  h.to = r.string(256);
  r.expect_done();
  return h;
}

}  // namespace

GatewayMesh::GatewayMesh(MeshOptions options, const DialFn& dial, const AcceptFn& accept)
    : options_(std::move(options)) {
  const size_t n = options_.site_names.size(), me = options_.site_index;
  NEBULA_CHECK(me < n && options_.addresses.size() == n, "site index ", me, " of ", n, " sites, ",
               options_.addresses.size(), " addresses");
  const std::string& my_name = options_.site_names[me];
  links_.resize(n);
  Deadline deadline = Deadline::after(options_.timeout);

  // Dial every lower-index site: send hello, expect the matching hello back.
  for (size_t j = 0; j < me; ++j) {
    const std::string& peer = options_.site_names[j];
    auto link = dial(options_.addresses[j], peer, deadline);
    link->send(wire::make_frame(wire::FrameType::kHello, 0, 0, hello_payload(options_.job, my_name, peer)), deadline);
    Hello h = read_hello(link->recv(deadline), peer);
    if (h.protocol != kMeshProtocol || h.job != options_.job || h.from != peer || h.to != my_name)
      throw Error(str_cat("gateway ", options_.addresses[j], " answered as site '", h.from, "' of job '", h.job,
                          "' (protocol ", h.protocol, "); expected site '", peer, "' of job '", options_.job,
                          "': check [[sites]] gateway addresses"));
    links_[j] = std::move(link);
    spdlog::info("connected to site {} at {}", peer, options_.addresses[j]);
  }
  // Accept every higher-index site; who it is comes from its hello. A connection that is not
  // a peer we expect is refused and logged; the others are not disturbed.
  size_t expected = n - 1 - me;
  while (expected > 0) {
    auto link = accept(deadline);
    Hello h;
    try {
      h = read_hello(link->recv(deadline), link->peer());
    } catch (const Error& e) {
      spdlog::warn("refused connection from {}: {}", link->peer(), e.what());
      continue;
    }
    size_t j = n;
    for (size_t k = me + 1; k < n; ++k)
      if (options_.site_names[k] == h.from) j = k;
    if (h.protocol != kMeshProtocol || h.job != options_.job || h.to != my_name || j == n || links_[j]) {
      spdlog::warn("refused connection from {}: says it is site '{}' of job '{}' (protocol {}) for site '{}'",
                   link->peer(), h.from, h.job, h.protocol, h.to);
      continue;
    }
    link->send(wire::make_frame(wire::FrameType::kHello, 0, 0, hello_payload(options_.job, my_name, h.from)),
               deadline);
    links_[j] = std::move(link);
    spdlog::info("accepted site {}", h.from);
    --expected;
  }
}

GatewayMesh::~GatewayMesh() { close(); }

void GatewayMesh::close() {
  for (auto& l : links_)
    if (l) l->close();
}

std::vector<std::vector<uint8_t>> GatewayMesh::all_gather(std::vector<uint8_t> payload) {
  const size_t n = num_sites(), me = options_.site_index;
  const uint64_t op = next_op_++;
  Deadline deadline = Deadline::after(options_.timeout);
  std::vector<std::vector<uint8_t>> out(n);
  if (n == 1) {
    out[me] = std::move(payload);
    return out;
  }
  wire::Frame frame = wire::make_frame(wire::FrameType::kData, op, 0, std::move(payload));
  // Sends run in parallel (an emulated or real WAN send blocks for the serialisation time);
  // receives run on this thread meanwhile, so two gateways sending big frames never deadlock.
  std::vector<std::future<void>> sends;
  for (size_t j = 0; j < n; ++j)
    if (j != me) sends.push_back(std::async(std::launch::async, [&, j] { links_[j]->send(frame, deadline); }));
  std::exception_ptr error;
  for (size_t j = 0; j < n && !error; ++j) {
    if (j == me) continue;
    try {
      wire::Frame f = links_[j]->recv(deadline);
      if (f.header.type != wire::FrameType::kData || f.header.op_id != op)
        throw Error(str_cat("site ", options_.site_names[j], " sent frame type ", static_cast<int>(f.header.type),
                            " for operation ", f.header.op_id, " while this site is at operation ", op,
                            ": the gateways ran different collectives"));
      out[j] = std::move(f.payload);
    } catch (...) {
      error = std::current_exception();
    }
  }
  for (auto& s : sends) {
    try {
      s.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  out[me] = std::move(frame.payload);
  return out;
}

uint64_t GatewayMesh::bytes_sent() const {
  uint64_t b = 0;
  for (const auto& l : links_)
    if (l) b += l->stats().bytes_sent;
  return b;
}

uint64_t GatewayMesh::bytes_received() const {
  uint64_t b = 0;
  for (const auto& l : links_)
    if (l) b += l->stats().bytes_received;
  return b;
}

}  // namespace nebula::collective
