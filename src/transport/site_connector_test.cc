// [6/7] hostile input at a gateway: connections that are not an expected peer of this job are
// refused and audited with the reason, each on its own, and the real peer still connects.
// Plaintext (security.insecure), so the frame and hello checks are reached directly; the TLS
// refusals (another CA) are covered by tls_link_test and the e2e test.
#include "transport/site_connector.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "nebula/error.h"
#include "transport/hello.h"
#include "transport/link_test_util.h"
#include "util/temp_dir.h"
#include "wire/frame.h"

namespace nebula::transport {
namespace {

using namespace std::chrono_literals;
using testing::raw_connect;

constexpr uint64_t kMaxFrame = 1 << 20;

ConnectorOptions options_for(size_t self, const std::vector<SiteAddress>& sites,
                             const std::shared_ptr<AuditLog>& audit) {
  ConnectorOptions o;
  o.job = "job-1";
  o.self = self;
  o.sites = sites;
  o.link.max_payload = kMaxFrame;
  o.handshake_timeout = 20s;  // only a bound: nothing here waits for it to pass
  o.audit = audit;
  return o;
}

// Reads from `fd` until the peer closes (EOF or reset); false if it is still open after 20 s.
bool closed_by_peer(int fd) {
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20000) <= 0) return false;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;  // 0: EOF; < 0: reset, also a close
  }
}

// Sends `bytes` on a fresh raw connection, closes our sending side and waits until the
// gateway hangs up.
void send_raw_and_expect_hangup(uint16_t port, const std::vector<uint8_t>& bytes) {
  const int fd = raw_connect(port);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  ::shutdown(fd, SHUT_WR);  // and nothing more: a gateway waiting for the rest sees EOF, not a stall
  EXPECT_TRUE(closed_by_peer(fd)) << "the gateway kept the connection open";
  ::close(fd);
}

// Dials like a gateway would, sends `hello`, and expects the gateway to hang up instead of
// confirming.
void send_hello_and_expect_refusal(uint16_t port, const Hello& hello) {
  auto link = TcpLink::connect("127.0.0.1", port, "a", Deadline::after(20s));
  Hello greeting = read_hello(link->recv(Deadline::after(20s)), "a");
  EXPECT_EQ(greeting.from, "a");
  link->send(hello_frame(hello), Deadline::after(20s));
  try {
    link->recv(Deadline::after(20s));
    ADD_FAILURE() << "the gateway confirmed a hello from '" << hello.from << "' of job '" << hello.job << "'";
  } catch (const PeerLost&) {
    // refused: the gateway closed the connection
  }
}

std::vector<nlohmann::json> audit_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Two sites' listeners and site a's connector, with an audit log in a temporary directory.
// As the gateway does (train/gateway.cc): accepted links take the listener's options, so the
// listener is where wan.max_frame must be given.
struct TwoSites {
  explicit TwoSites(const std::string& name)
      : dir(name),
        audit_path(dir.file("audit.jsonl")),
        audit(std::make_shared<AuditLog>(audit_path)),
        listener_b(std::make_unique<TcpListener>("127.0.0.1", 0, options_for(1, {}, nullptr).link)) {
    auto listener_a = std::make_unique<TcpListener>("127.0.0.1", 0, options_for(0, {}, nullptr).link);
    port = listener_a->port();
    sites = {{"a", "127.0.0.1:" + std::to_string(port)}, {"b", "127.0.0.1:" + std::to_string(listener_b->port())}};
    a = std::make_unique<SiteConnector>(options_for(0, sites, audit), std::move(listener_a));
  }
  nebula::testing::TempDir dir;
  std::string audit_path;
  std::shared_ptr<AuditLog> audit;
  std::unique_ptr<TcpListener> listener_b;
  uint16_t port = 0;
  std::vector<SiteAddress> sites;
  std::unique_ptr<SiteConnector> a;
};

TEST(SiteConnector, HostileConnectionsAreRefusedAndAuditedAndTheRealPeerStillConnects) {
  TwoSites t("hostile");
  const std::string& audit_path = t.audit_path;
  const uint16_t port = t.port;
  SiteConnector& a = *t.a;

  // (1) Bytes that are not nebula's protocol at all.
  send_raw_and_expect_hangup(port, std::vector<uint8_t>(64, 'G'));
  // (2) A well-formed frame header announcing a payload above wan.max_frame: refused before
  // anything is allocated (the 1 TiB is never sent).
  wire::FrameHeader huge;
  huge.type = wire::FrameType::kHello;
  huge.payload_len = uint64_t{1} << 40;
  const auto header = wire::encode_header(huge);
  send_raw_and_expect_hangup(port, std::vector<uint8_t>(header.begin(), header.end()));
  // (3) A header cut short, then EOF from our side.
  send_raw_and_expect_hangup(port, std::vector<uint8_t>(header.begin(), header.begin() + 10));
  // (4)-(7) Proper hellos that do not belong here.
  send_hello_and_expect_refusal(port, {kHelloProtocol, "another-job", "b", "a", 0, 1, 0});
  send_hello_and_expect_refusal(port, {kHelloProtocol, "job-1", "mallory", "a", 0, 1, 0});
  send_hello_and_expect_refusal(port, {kHelloProtocol, "job-1", "b", "zeta", 0, 1, 0});
  send_hello_and_expect_refusal(port, {kHelloProtocol, "job-1", "b", "a", 3, 1, 0});
  send_hello_and_expect_refusal(port, {kHelloProtocol + 1, "job-1", "b", "a", 0, 1, 0});

  // The real site b connects, and its link carries a frame.
  SiteConnector b(options_for(1, t.sites, t.audit), std::move(t.listener_b));
  auto b_links = std::async(std::launch::async, [&] { return b.connect_all(Deadline::after(60s)); });
  auto a_links = a.connect_all(Deadline::after(60s));
  auto links_of_b = b_links.get();
  ASSERT_TRUE(a_links[1]);
  ASSERT_TRUE(links_of_b[0]);
  wire::Frame f;
  f.header.type = wire::FrameType::kData;
  f.header.op_id = 7;
  f.payload = {1, 2, 3};
  f.header.payload_len = f.payload.size();
  links_of_b[0]->send(f, Deadline::after(20s));
  wire::Frame got = a_links[1]->recv(Deadline::after(20s));
  EXPECT_EQ(got.header.op_id, 7u);
  EXPECT_EQ(got.payload, f.payload);

  // Every hostile attempt is one "refused" line saying why; the real peer's are "accepted".
  const std::vector<std::string> reasons = {
      "bad magic",
      str_cat("payload_len 1099511627776 exceeds the maximum ", kMaxFrame, " (LinkOptions.max_payload, set by "
              "wan.max_frame"),
      "mid-frame",
      "job 'another-job', expected 'job-1'",
      "site 'mallory' is not a site that dials this one",
      "wants site 'zeta', this is 'a'",
      "stream 3 of 1",
      str_cat("protocol ", kHelloProtocol + 1, ", expected ", kHelloProtocol),
  };
  const auto lines = audit_lines(audit_path);
  size_t refused = 0, accepted = 0;
  for (const auto& j : lines) {
    EXPECT_EQ(j["local_site"], j["outcome"] == "accepted" && j["reason"] == "dialed" ? "b" : "a") << j.dump();
    refused += j["outcome"] == "refused";
    accepted += j["outcome"] == "accepted";
  }
  EXPECT_EQ(refused, reasons.size()) << nlohmann::json(lines).dump(1);
  EXPECT_EQ(accepted, 2u) << nlohmann::json(lines).dump(1);  // a accepted b's stream; b's dial was accepted
  for (const auto& why : reasons) {
    bool found = false;
    for (const auto& j : lines)
      found |= j["outcome"] == "refused" && j["reason"].get<std::string>().find(why) != std::string::npos;
    EXPECT_TRUE(found) << "no refused line saying \"" << why << "\" in\n" << nlohmann::json(lines).dump(1);
  }
  for (auto& l : a_links)
    if (l) l->close();
  for (auto& l : links_of_b)
    if (l) l->close();
  a.close();
  b.close();
}

// One host flooding the gateway gets at most its per-address share of handshakes: its next
// connection is refused at once, and a real peer on another address connects while the
// flood still holds its slots.
TEST(SiteConnector, OneFloodingHostCannotTakeTheSlotsARealPeerNeeds) {
  TwoSites t("host-flood");
  SiteConnector& a = *t.a;
  EXPECT_EQ(a.max_handshakes_per_address(), SiteConnector::kMinHandshakesPerAddress);  // 2 sites, 1 stream
  std::vector<int> idle;
  for (size_t i = 0; i < a.max_handshakes_per_address(); ++i) {
    const int fd = raw_connect(t.port, "127.0.0.2");
    ASSERT_GE(fd, 0);
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 20000), 1) << "no greeting on connection " << i;
    idle.push_back(fd);
  }
  const int extra = raw_connect(t.port, "127.0.0.2");
  ASSERT_GE(extra, 0);
  char byte;
  pollfd p{extra, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 20000), 1);
  EXPECT_LE(::recv(extra, &byte, 1, 0), 0) << "the host's connection over its share got a greeting";
  ::close(extra);

  // The real peer dials from 127.0.0.1 while all of 127.0.0.2's connections are still open.
  SiteConnector b(options_for(1, t.sites, t.audit), std::move(t.listener_b));
  auto b_links = std::async(std::launch::async, [&] { return b.connect_all(Deadline::after(60s)); });
  auto a_links = a.connect_all(Deadline::after(60s));
  auto links_of_b = b_links.get();
  EXPECT_TRUE(a_links[1] && links_of_b[0]);
  for (int fd : idle) ::close(fd);

  size_t from_host = 0;
  for (const auto& j : audit_lines(t.audit_path))
    from_host += j["reason"].get<std::string>().starts_with("too many connections in handshake from 127.0.0.2 (16)");
  EXPECT_EQ(from_host, 1u);
  for (auto& l : a_links)
    if (l) l->close();
  for (auto& l : links_of_b)
    if (l) l->close();
  b.close();
}

// A flood of idle connections takes at most kMaxConcurrentHandshakes handshake threads; the
// next connection is refused at once and audited, and once the flood is gone the real peer
// connects. (Without the bound each connection took a thread until handshake_timeout, and a
// failed thread start ended the process.)
TEST(SiteConnector, AFloodOfIdleConnectionsIsBoundedAndTheRealPeerStillConnects) {
  TwoSites t("flood");
  const std::string& audit_path = t.audit_path;
  const uint16_t port = t.port;
  SiteConnector& a = *t.a;

  // Each idle connection holds a handshake: the gateway's greeting shows it has started. They
  // come from many hosts (127.0.0.2, .3, ...), each within its per-address share.
  std::vector<int> idle;
  const size_t per_host = a.max_handshakes_per_address();
  for (size_t i = 0; i < SiteConnector::kMaxConcurrentHandshakes; ++i) {
    const std::string from = "127.0.0." + std::to_string(2 + i / per_host);
    const int fd = raw_connect(port, from.c_str());
    ASSERT_GE(fd, 0);
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 20000), 1) << "no greeting on connection " << i;
    idle.push_back(fd);
  }
  // One more, from a host with no handshake yet: refused at once, without a greeting.
  const int extra = raw_connect(port, "127.0.0.200");
  ASSERT_GE(extra, 0);
  char byte;
  pollfd p{extra, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 20000), 1);
  EXPECT_LE(::recv(extra, &byte, 1, 0), 0) << "the connection over the bound got a greeting";
  ::close(extra);
  for (int fd : idle) ::close(fd);
  // Every flood connection has been given up (audited) before the real peer dials.
  for (int i = 0; i < 400 && audit_lines(audit_path).size() < idle.size() + 1; ++i)
    std::this_thread::sleep_for(50ms);
  ASSERT_EQ(audit_lines(audit_path).size(), idle.size() + 1);

  SiteConnector b(options_for(1, t.sites, t.audit), std::move(t.listener_b));
  auto b_links = std::async(std::launch::async, [&] { return b.connect_all(Deadline::after(60s)); });
  auto a_links = a.connect_all(Deadline::after(60s));
  auto links_of_b = b_links.get();
  EXPECT_TRUE(a_links[1] && links_of_b[0]);

  size_t too_many = 0, refused = 0;
  for (const auto& j : audit_lines(audit_path)) {
    refused += j["outcome"] == "refused";
    too_many += j["reason"].get<std::string>().starts_with("too many connections in handshake");
  }
  EXPECT_EQ(too_many, 1u);
  EXPECT_EQ(refused, idle.size() + 1);
  for (auto& l : a_links)
    if (l) l->close();
  for (auto& l : links_of_b)
    if (l) l->close();
}

}  // namespace
}  // namespace nebula::transport
