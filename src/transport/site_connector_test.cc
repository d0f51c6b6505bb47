// [6/7] hostile input at a gateway: connections that are not an expected peer of this job are
// refused and audited with the reason, each on its own, and the real peer still connects.
// Plaintext (security.insecure), so the frame and hello checks are reached directly; the TLS
// refusals (another CA) are covered by tls_link_test and the e2e test.
#include "transport/site_connector.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
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
#include "transport/certs.h"
#include "transport/link_test_util.h"
#include "util/temp_dir.h"
#include "wire/frame.h"

namespace nebula::transport {
namespace {

using namespace std::chrono_literals;
using testing::raw_connect;

constexpr uint64_t kMaxFrame = 1 << 20;

ConnectorOptions options_for(size_t self, const std::vector<SiteAddress>& sites,
                             const std::shared_ptr<AuditLog>& audit, uint64_t max_frame = kMaxFrame) {
  ConnectorOptions o;
  o.job = "job-1";
  o.self = self;
  o.sites = sites;
  o.link.max_payload = max_frame;
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

// Refusals of connections from `source` in the audit log: lines one by one, and the sum of
// the "N more refusals from <source>" lines.
std::pair<size_t, size_t> refusals_in(const std::vector<nlohmann::json>& lines, const std::string& source) {
  size_t one_by_one = 0, counted = 0;
  for (const auto& j : lines) {
    if (j["outcome"] == "accepted") continue;
    const std::string address = j["address"], why = j["reason"];
    if (address.starts_with(source + ":")) ++one_by_one;
    if (address == source && why.find(" more refusals from " + source + " ") != std::string::npos)
      counted += std::stoull(why);
  }
  return {one_by_one, counted};
}

// Two sites' listeners and site a's connector, with an audit log in a temporary directory.
// As the gateway does (site/gateway.cc): accepted links take the listener's options, so the
// listener is where wan.max_frame must be given.
struct TwoSites {
  explicit TwoSites(const std::string& name, uint64_t max_frame = kMaxFrame)
      : dir(name),
        audit_path(dir.file("audit.jsonl")),
        audit(std::make_shared<AuditLog>(audit_path)),
        listener_b(std::make_unique<TcpListener>("127.0.0.1", 0, options_for(1, {}, nullptr, max_frame).link)) {
    auto listener_a = std::make_unique<TcpListener>("127.0.0.1", 0, options_for(0, {}, nullptr, max_frame).link);
    port = listener_a->port();
    sites = {{"a", "127.0.0.1:" + std::to_string(port)}, {"b", "127.0.0.1:" + std::to_string(listener_b->port())}};
    a = std::make_unique<SiteConnector>(options_for(0, sites, audit, max_frame), std::move(listener_a));
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
  // (2) A well-formed frame header announcing a hello above any limit: refused before
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
      "payload_len 1099511627776 of a hello frame exceeds the maximum 65536",
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
  // Every flood connection has been given up (counted) before the real peer dials.
  for (int i = 0; i < 400 && a.refusals_seen() < idle.size() + 1; ++i) std::this_thread::sleep_for(50ms);
  ASSERT_EQ(a.refusals_seen(), idle.size() + 1);

  SiteConnector b(options_for(1, t.sites, t.audit), std::move(t.listener_b));
  auto b_links = std::async(std::launch::async, [&] { return b.connect_all(Deadline::after(60s)); });
  auto a_links = a.connect_all(Deadline::after(60s));
  auto links_of_b = b_links.get();
  EXPECT_TRUE(a_links[1] && links_of_b[0]);

  for (auto& l : a_links)
    if (l) l->close();
  for (auto& l : links_of_b)
    if (l) l->close();
  a.close();  // writes the "N more refusals" lines of the minutes still open

  // Each flooding host is in the log as at most kAuditedRefusalsPerMinute lines a minute plus
  // the count of the rest: nothing is lost, and the log does not grow with the flood.
  const auto lines = audit_lines(audit_path);
  size_t too_many = 0;
  for (const auto& j : lines) too_many += j["reason"].get<std::string>().starts_with("too many connections in handshake");
  EXPECT_EQ(too_many, 1u);
  size_t total = 0;
  for (size_t h = 0; h < SiteConnector::kMaxConcurrentHandshakes / per_host; ++h) {
    const auto [one_by_one, counted] = refusals_in(lines, "127.0.0." + std::to_string(2 + h));
    EXPECT_LE(one_by_one, SiteConnector::kAuditedRefusalsPerMinute * 2) << h;  // a minute may roll over
    EXPECT_EQ(one_by_one + counted, per_host) << h;
    total += one_by_one + counted;
  }
  EXPECT_EQ(total, idle.size());
}

// 10 000 connections from one host, each refused: the audit log stays a few lines long (the
// rest are counted in one line), and the real peer still connects.
TEST(SiteConnector, TenThousandRefusalsLeaveTheAuditLogBoundedAndTheRealPeerConnects) {
  TwoSites t("ten-thousand");
  SiteConnector& a = *t.a;
  constexpr size_t kFlood = 10000;
  for (size_t i = 0; i < kFlood; ++i) {
    const int fd = raw_connect(t.port, "127.0.0.3");
    ASSERT_GE(fd, 0) << i;
    ::close(fd);  // gone before its hello: refused
  }
  for (int i = 0; i < 1200 && a.refusals_seen() < kFlood; ++i) std::this_thread::sleep_for(50ms);
  ASSERT_EQ(a.refusals_seen(), kFlood);
  const size_t lines_during = audit_lines(t.audit_path).size();
  EXPECT_LE(lines_during, 3 * SiteConnector::kAuditedRefusalsPerMinute);

  SiteConnector b(options_for(1, t.sites, t.audit), std::move(t.listener_b));
  auto b_links = std::async(std::launch::async, [&] { return b.connect_all(Deadline::after(60s)); });
  auto a_links = a.connect_all(Deadline::after(60s));
  auto links_of_b = b_links.get();
  EXPECT_TRUE(a_links[1] && links_of_b[0]);
  for (auto& l : a_links)
    if (l) l->close();
  for (auto& l : links_of_b)
    if (l) l->close();
  a.close();
  b.close();
  const auto lines = audit_lines(t.audit_path);
  const auto [one_by_one, counted] = refusals_in(lines, "127.0.0.3");
  EXPECT_EQ(one_by_one + counted, kFlood);
  EXPECT_LE(lines.size(), 3 * SiteConnector::kAuditedRefusalsPerMinute + 4) << nlohmann::json(lines).dump(1);
}

// Out of descriptors, accept() fails (EMFILE) with the connection left in the backlog: the
// acceptor backs off and keeps listening, and the connection gets its greeting once
// descriptors are free again. (It used to stop accepting for the rest of the job.)
TEST(SiteConnector, TheAcceptorKeepsAcceptingAfterEmfile) {
  TwoSites t("emfile");
  SiteConnector& a = *t.a;
  // Made now, connected once no descriptor is free: then only the kernel's backlog holds it.
  const int waiting = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(waiting, 0);
  const int base = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(base, 0);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  const uint64_t before = a.refusals_seen();
  std::vector<int> hogs;
  rlimit low = old;
  low.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  for (int fd; (fd = ::dup(base)) >= 0;) hogs.push_back(fd);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(t.port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int connected = ::connect(waiting, reinterpret_cast<sockaddr*>(&to), sizeof to);
  // The acceptor hits EMFILE (counted as a failed attempt) at least once, and carries on.
  for (int i = 0; i < 400 && a.refusals_seen() < before + 2; ++i) std::this_thread::sleep_for(10ms);
  const uint64_t failures = a.refusals_seen() - before;
  for (int fd : hogs) ::close(fd);
  ::close(base);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_EQ(connected, 0);
  EXPECT_GE(failures, 1u);
  pollfd p{waiting, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 20000), 1) << "no greeting after the descriptors came back";
  char byte;
  EXPECT_EQ(::recv(waiting, &byte, 1, 0), 1) << "the acceptor stopped";
  ::close(waiting);
  bool audited = false;
  for (const auto& j : audit_lines(t.audit_path))
    audited |= j["outcome"] == "failed" && j["reason"].get<std::string>().find("Too many open files") != std::string::npos;
  EXPECT_TRUE(audited);
}

// A gateway configured for gigabyte frames (the old default) reads a hello under the hello's
// own 64 KiB limit, and a pre-authentication data frame under the handshake's: a header
// claiming 1 GiB - 1 costs nothing (peak RSS), where it used to be zero-filled at once.
TEST(SiteConnector, AHugeHelloOrDataFrameBeforeAuthenticationIsRefusedWithoutAllocatingIt) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  TwoSites t("huge-hello", kGiB);
  const auto peak_kib = [] {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
      if (line.starts_with("VmHWM:")) return std::stoull(line.substr(6));
    return 0ull;
  };
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // the peak RSS starts again from the current RSS
  }
  const unsigned long long start = peak_kib();
  ASSERT_GT(start, 0u);
  for (wire::FrameType type : {wire::FrameType::kHello, wire::FrameType::kData}) {
    wire::FrameHeader h;
    h.type = type;
    h.payload_len = kGiB - 1;
    const auto header = wire::encode_header(h);
    std::vector<uint8_t> bytes(header.begin(), header.end());
    bytes.resize(bytes.size() + (1 << 20), 0x5A);  // a first MiB of the claimed payload
    const int fd = raw_connect(t.port);
    ASSERT_GE(fd, 0);
    ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);  // may be cut short by the hangup
    ::shutdown(fd, SHUT_WR);
    EXPECT_TRUE(closed_by_peer(fd));
    ::close(fd);
  }
  const unsigned long long grew_mib = (peak_kib() - start) / 1024;
  std::printf("peak RSS grew by %llu MiB\n", grew_mib);
  EXPECT_LT(grew_mib, 64u);
  t.a->close();
  size_t hello = 0, data = 0;
  for (const auto& j : audit_lines(t.audit_path)) {
    const std::string why = j["reason"];
    hello += why.find("payload_len 1073741823 of a hello frame exceeds the maximum 65536") != std::string::npos;
    data += why.find("payload_len 1073741823 of a data frame exceeds the maximum 65536") != std::string::npos;
  }
  EXPECT_EQ(hello, 1u);
  EXPECT_EQ(data, 1u);
}

// Over mutual TLS the site is the certificate's identity and nothing else: a valid
// certificate of site c whose hello claims to be b is refused, and audited with both names and
// c's fingerprint. (A certificate of another job: tls_link_test, refused inside the handshake.)
TEST(SiteConnector, OverTlsAValidCertificateOfAnotherSiteCannotClaimToBeB) {
  nebula::testing::TempDir dir("tls-identity");
  const std::string certs = dir.file("certs");
  create_ca(certs);
  for (const char* site : {"a", "b", "c"}) issue_site_certificate(certs, site, "job-1");
  auto audit = std::make_shared<AuditLog>(dir.file("audit.jsonl"));
  auto listener_a = std::make_unique<TcpListener>("127.0.0.1", 0);
  const uint16_t port = listener_a->port();
  std::vector<SiteAddress> sites = {
      {"a", "127.0.0.1:" + std::to_string(port)}, {"b", "127.0.0.1:1"}, {"c", "127.0.0.1:2"}};
  auto with_tls = [&](size_t self) {
    ConnectorOptions o = options_for(self, sites, audit);
    o.tls = TlsContext::create(TlsFiles::for_site(certs, sites[self].name));
    return o;
  };
  SiteConnector a(with_tls(0), std::move(listener_a));

  auto ctx_c = TlsContext::create(TlsFiles::for_site(certs, "c"));
  auto link = TlsLink::client(TcpLink::connect("127.0.0.1", port, "a", Deadline::after(20s)), ctx_c, "a",
                              Deadline::after(20s));
  EXPECT_EQ(read_hello(link->recv(Deadline::after(20s)), "a").from, "a");
  link->send(hello_frame({kHelloProtocol, "job-1", "b", "a", 0, 1, 0}), Deadline::after(20s));
  EXPECT_THROW(link->recv(Deadline::after(20s)), NetworkError);  // no confirmation: refused
  link.reset();
  a.close();
  bool refused = false;
  for (const auto& j : audit_lines(dir.file("audit.jsonl")))
    refused |= j["outcome"] == "refused" &&
               j["reason"].get<std::string>().find("certificate names site 'c' but hello claims 'b'") != std::string::npos &&
               j["fingerprint"] == certificate_fingerprint(site_cert_path(certs, "c"));
  EXPECT_TRUE(refused) << nlohmann::json(audit_lines(dir.file("audit.jsonl"))).dump(1);
}

// wan.allow: a connection from an address outside it is refused before any handshake (no
// greeting) and audited; one inside gets its greeting.
TEST(SiteConnector, AnAllowListRefusesOtherAddressesBeforeAnyHandshake) {
  nebula::testing::TempDir dir("allow");
  auto audit = std::make_shared<AuditLog>(dir.file("audit.jsonl"));
  auto listener = std::make_unique<TcpListener>("127.0.0.1", 0);
  const uint16_t port = listener->port();
  ConnectorOptions o = options_for(0, {{"a", "127.0.0.1:" + std::to_string(port)}, {"b", "127.0.0.1:1"}}, audit);
  o.allow = {AddressRange::parse("127.0.0.1"), AddressRange::parse("10.0.0.0/8")};
  SiteConnector a(o, std::move(listener));
  auto greeted = [&](const char* from) {
    const int fd = raw_connect(port, from);
    EXPECT_GE(fd, 0);
    pollfd p{fd, POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 20000), 1);
    char byte;
    const bool got = ::recv(fd, &byte, 1, 0) == 1;
    ::close(fd);
    return got;
  };
  EXPECT_FALSE(greeted("127.0.0.9"));
  EXPECT_TRUE(greeted("127.0.0.1"));
  a.close();
  bool audited = false;
  for (const auto& j : audit_lines(dir.file("audit.jsonl")))
    audited |= j["address"].get<std::string>().starts_with("127.0.0.9:") &&
               j["reason"].get<std::string>().starts_with("address not in wan.allow");
  EXPECT_TRUE(audited);
}

TEST(SiteConnector, AddressRangesParseAndMatch) {
  const AddressRange v4 = AddressRange::parse("10.1.0.0/16");
  EXPECT_TRUE(v4.contains("10.1.200.3:4000"));
  EXPECT_FALSE(v4.contains("10.2.0.1:4000"));
  EXPECT_FALSE(v4.contains("[2001:db8::1]:4000"));
  const AddressRange v6 = AddressRange::parse("2001:db8::/32");
  EXPECT_TRUE(v6.contains("[2001:db8:ffff::1]:4000"));
  EXPECT_FALSE(v6.contains("[2001:db9::1]:4000"));
  EXPECT_TRUE(AddressRange::parse("192.0.2.7").contains("192.0.2.7:1"));
  EXPECT_FALSE(AddressRange::parse("192.0.2.7").contains("192.0.2.8:1"));
  EXPECT_TRUE(AddressRange::parse("0.0.0.0/0").contains("203.0.113.5:1"));
  for (const char* bad : {"10.0.0.0/33", "10.0.0/8", "host.example.org", "::1/129", "10.0.0.0/", "10.0.0.0/x"}) {
    try {
      AddressRange::parse(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("\"") + bad + "\""), std::string::npos) << e.what();
    }
  }
}

TEST(SiteConnector, SourcesAreIpv4HostsAndIpv6Slash64s) {
  EXPECT_EQ(SiteConnector::source_of("10.0.0.7:4000"), "10.0.0.7");
  EXPECT_EQ(SiteConnector::source_of("[2001:db8:1:2:aaaa:bbbb:cccc:dddd]:4000"), "[2001:db8:1:2::]/64");
  EXPECT_EQ(SiteConnector::source_of("[2001:db8:1:2::1]:5"), SiteConnector::source_of("[2001:db8:1:2:ffff::9]:6"));
  EXPECT_NE(SiteConnector::source_of("[2001:db8:1:2::1]:5"), SiteConnector::source_of("[2001:db8:1:3::1]:5"));
  EXPECT_EQ(SiteConnector::source_of("[::1]:4000"), "[::]/64");
}

}  // namespace
}  // namespace nebula::transport
