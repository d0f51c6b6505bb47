#include "transport/tls_link.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "transport/certs.h"
#include "transport/link_test_util.h"

namespace nebula::transport {
namespace {

namespace fs = std::filesystem;
using namespace nebula::transport::testing;
using wire::Frame;
using wire::FrameType;
using wire::make_frame;

// Certificates for the whole suite, all of job "job-1" unless said otherwise: CA "main" issues
// alpha, beta, gamma, an expired and a not-yet-valid one; CA "other" issues its own alpha and
// beta; in "job2", CA "main" issues alpha and beta of job "job-2".
class TlsLinkTest : public ::testing::Test {
 protected:
  static inline std::string root_, main_, other_, job2_;

  static void SetUpTestSuite() {
    std::string templ = (fs::temp_directory_path() / "nebula_tls_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    root_ = templ;
    main_ = root_ + "/main";
    other_ = root_ + "/other";
    create_ca(main_);
    for (const char* site : {"alpha", "beta", "gamma"}) issue_site_certificate(main_, site, "job-1");
    issue_site_certificate(main_, "expired", "job-1", 1, -10 * 86400L);
    issue_site_certificate(main_, "future", "job-1", 30, 86400L);
    create_ca(other_);
    for (const char* site : {"alpha", "beta"}) issue_site_certificate(other_, site, "job-1");
    job2_ = root_ + "/job2";
    fs::create_directories(job2_);
    fs::copy_file(ca_cert_path(main_), ca_cert_path(job2_));
    fs::copy_file(ca_key_path(main_), ca_key_path(job2_));
    for (const char* site : {"alpha", "beta"}) issue_site_certificate(job2_, site, "job-2");
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // The context of `site` whose certificate comes from `cert_dir`, trusting `ca_dir`'s CA.
  static std::shared_ptr<TlsContext> ctx(const std::string& site, const std::string& cert_dir = main_,
                                         const std::string& ca_dir = main_) {
    return TlsContext::create({ca_cert_path(ca_dir), site_cert_path(cert_dir, site), site_key_path(cert_dir, site)});
  }

  struct Result {
    std::unique_ptr<TlsLink> client, server;
    std::exception_ptr client_error, server_error;
  };

  // One connection on `listener`: the server handshake in a thread, the client here.
  static Result handshake(TcpListener& listener, std::shared_ptr<TlsContext> client_ctx,
                          std::shared_ptr<TlsContext> server_ctx, const std::string& expected_site) {
    Result r;
    auto server = std::async(std::launch::async, [&] {
      Deadline dl = Deadline::after(10s);
      return TlsLink::server(listener.accept(dl, "client-peer"), server_ctx, dl);
    });
    try {
      Deadline dl = Deadline::after(10s);
      r.client = TlsLink::client(TcpLink::connect("127.0.0.1", listener.port(), expected_site, dl), client_ctx,
                                 expected_site, dl);
    } catch (...) {
      r.client_error = std::current_exception();
    }
    try {
      r.server = server.get();
    } catch (...) {
      r.server_error = std::current_exception();
    }
    return r;
  }

  // A good pair (alpha connects to beta) still works on `listener`.
  static void expect_good_peer(TcpListener& listener) {
    auto r = handshake(listener, ctx("alpha"), ctx("beta"), "beta");
    ASSERT_FALSE(r.client_error || r.server_error) << "a good peer was not accepted after a refusal";
    EXPECT_EQ(r.client->peer_identity(), "beta");
    EXPECT_EQ(r.server->peer_identity(), "alpha");
    r.client->send(make_frame(FrameType::kHello, 1, 2, pattern(100)), Deadline::after(5s));
    EXPECT_EQ(r.server->recv(Deadline::after(5s)).payload, pattern(100));
  }
};

// Rethrows `error` and returns the TlsHandshakeError it holds, failing the test when it is
// something else or its reason lacks `needle`.
TlsHandshakeError expect_refused(std::exception_ptr error, const std::string& needle) {
  if (!error) {
    ADD_FAILURE() << "expected TlsHandshakeError containing \"" << needle << "\", got success";
    return TlsHandshakeError("", "", "", "", "");
  }
  try {
    std::rethrow_exception(error);
  } catch (const TlsHandshakeError& e) {
    EXPECT_NE(e.reason().find(needle), std::string::npos) << "reason: " << e.reason() << "\nmessage: " << e.what();
    EXPECT_NE(std::string(e.what()).find(e.reason()), std::string::npos) << e.what();
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected TlsHandshakeError containing \"" << needle << "\", got: " << e.what();
  }
  return TlsHandshakeError("", "", "", "", "");
}

// A client whose certificate the server refused learns it on its first recv() (TLS 1.3).
void expect_client_told_refused(TlsLink* client, const std::string& needle) {
  ASSERT_NE(client, nullptr);
  try {
    client->recv(Deadline::after(5s));
    ADD_FAILURE() << "expected AuthError";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST_F(TlsLinkTest, GoodPeersExchangeFramesBothWays) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta"), "beta");
  ASSERT_FALSE(r.client_error || r.server_error);
  EXPECT_EQ(r.client->peer_identity(), "beta");
  EXPECT_EQ(r.server->peer_identity(), "alpha");
  EXPECT_EQ(r.client->peer_fingerprint(), certificate_fingerprint(site_cert_path(main_, "beta")));
  EXPECT_EQ(r.server->peer_fingerprint(), certificate_fingerprint(site_cert_path(main_, "alpha")));
  EXPECT_EQ(r.client->context().name(), "alpha");
  EXPECT_EQ(r.client->peer(), "beta");
  EXPECT_EQ(r.server->peer(), "client-peer");

  const std::vector<size_t> sizes = {0, 1, 64 * 1024, 16 * 1024 * 1024};
  std::vector<Frame> frames;
  for (size_t i = 0; i < sizes.size(); ++i)
    frames.push_back(make_frame(FrameType::kData, 7, i, pattern(sizes[i], static_cast<uint32_t>(i + 1)), 0, 2));
  // Client -> server, then the server echoes each frame back.
  auto sender = std::async(std::launch::async, [&] {
    for (const auto& f : frames) r.client->send(f, Deadline::after(30s));
  });
  auto echo = std::async(std::launch::async, [&] {
    for (size_t i = 0; i < frames.size(); ++i) r.server->send(r.server->recv(Deadline::after(30s)), Deadline::after(30s));
  });
  for (size_t i = 0; i < frames.size(); ++i) {
    Frame got = r.client->recv(Deadline::after(30s));
    EXPECT_EQ(got.header.seq, i);
    EXPECT_EQ(got.header.codec, 2);
    ASSERT_EQ(got.payload.size(), sizes[i]);
    EXPECT_TRUE(got.payload == frames[i].payload) << "payload " << i << " differs";
  }
  sender.get();
  echo.get();
  auto cs = r.client->stats(), ss = r.server->stats();
  EXPECT_EQ(cs.frames_sent, frames.size());
  EXPECT_EQ(ss.frames_received, frames.size());
  EXPECT_EQ(cs.bytes_sent, ss.bytes_received);  // frame bytes, not TLS records
  // The wire counters are the records: the handshake and every record's header and tag on top
  // (16 MiB in 16 KiB records: 1024 x 22 bytes at least).
  EXPECT_GT(cs.wire_bytes_sent, cs.bytes_sent + 1024 * 22);
  EXPECT_GT(cs.wire_bytes_received, cs.bytes_received + 1024 * 22);
  EXPECT_EQ(cs.wire_bytes_sent, ss.wire_bytes_received);  // every byte one end wrote, the other read
}

// send() and recv() on one link from two threads at once: the SSL object is shared.
TEST_F(TlsLinkTest, BothDirectionsAtOnce) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta"), "beta");
  ASSERT_FALSE(r.client_error || r.server_error);
  constexpr int kFrames = 100;
  auto send_all = [](TlsLink* link, uint32_t seed) {
    for (int i = 0; i < kFrames; ++i)
      link->send(make_frame(FrameType::kData, seed, i, pattern(40 * 1024 + i, seed + i)), Deadline::after(30s));
  };
  auto recv_all = [](TlsLink* link, uint32_t seed) {
    for (int i = 0; i < kFrames; ++i) {
      Frame f = link->recv(Deadline::after(30s));
      ASSERT_EQ(f.header.op_id, seed);
      ASSERT_EQ(f.header.seq, static_cast<uint64_t>(i));
      ASSERT_TRUE(f.payload == pattern(40 * 1024 + i, seed + i));
    }
  };
  auto s1 = std::async(std::launch::async, send_all, r.client.get(), 1000);
  auto s2 = std::async(std::launch::async, send_all, r.server.get(), 2000);
  auto r1 = std::async(std::launch::async, recv_all, r.server.get(), 1000);
  auto r2 = std::async(std::launch::async, recv_all, r.client.get(), 2000);
  s1.get();
  s2.get();
  r1.get();
  r2.get();
}

TEST_F(TlsLinkTest, CloseWakesBlockedRecvAndPeerSeesPeerLost) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta"), "beta");
  ASSERT_FALSE(r.client_error || r.server_error);
  auto blocked = std::async(std::launch::async, [&] { r.client->recv(Deadline::never()); });
  std::this_thread::sleep_for(50ms);
  r.client->close();
  ASSERT_EQ(blocked.wait_for(5s), std::future_status::ready);
  EXPECT_THROW(blocked.get(), PeerLost);
  EXPECT_THROW(r.client->send(make_frame(FrameType::kBye, 0, 0, {}), Deadline::after(1s)), PeerLost);
  try {
    r.server->recv(Deadline::after(5s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("peer closed the connection"), std::string::npos) << e.what();
  }
  // Writing to the dead peer: PeerLost, never SIGPIPE (which would kill this test).
  r.client.reset();
  auto frame = make_frame(FrameType::kData, 0, 0, pattern(1000));
  EXPECT_THROW(
      {
        for (int i = 0; i < 1000; ++i) r.server->send(frame, Deadline::after(5s));
      },
      PeerLost);
}

TEST_F(TlsLinkTest, RecvTimeoutKeepsTheLinkUsable) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta"), "beta");
  ASSERT_FALSE(r.client_error || r.server_error);
  EXPECT_THROW(r.server->recv(Deadline::after(100ms)), Timeout);
  r.client->send(make_frame(FrameType::kHeartbeat, 0, 1, {}), Deadline::after(5s));
  EXPECT_EQ(r.server->recv(Deadline::after(5s)).header.type, FrameType::kHeartbeat);
}

// The peer does not read; small frames fill the socket buffers until one send() times
// out. OpenSSL then holds an encrypted record of that frame, so the link must be broken
// (not "usable" with a stale record that the next frame would be glued to), and
// everything the peer did receive is intact.
TEST_F(TlsLinkTest, SendTimeoutOnFullBuffersBreaksTheLinkCleanly) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta"), "beta");
  ASSERT_FALSE(r.client_error || r.server_error);
  uint64_t sent = 0;
  bool timed_out = false;
  for (; sent < 1000000 && !timed_out; ++sent) {
    try {
      r.client->send(make_frame(FrameType::kData, 1, sent, pattern(1000, static_cast<uint32_t>(sent))),
                     Deadline::after(50ms));
    } catch (const Timeout&) {
      timed_out = true;
    }
  }
  ASSERT_TRUE(timed_out);
  try {
    r.client->send(make_frame(FrameType::kHeartbeat, 0, 0, {}), Deadline::after(1s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("link broken after"), std::string::npos) << e.what();
  }
  uint64_t got = 0;
  try {
    for (;; ++got) {
      Frame f = r.server->recv(Deadline::after(5s));
      ASSERT_EQ(f.header.seq, got);
      ASSERT_TRUE(f.payload == pattern(1000, static_cast<uint32_t>(got)));
    }
  } catch (const PeerLost&) {
    // the broken sender shut the socket down after its last complete record
  }
  EXPECT_GT(got, 0u);
  EXPECT_LT(got, sent);
}

TEST_F(TlsLinkTest, ClientCertificateFromAnotherCaIsRefused) {
  TcpListener listener("127.0.0.1", 0);
  // The client trusts the right CA but carries a certificate of another one.
  auto r = handshake(listener, ctx("alpha", other_, main_), ctx("beta"), "beta");
  auto e = expect_refused(r.server_error, "certificate signed by an unknown CA");
  EXPECT_EQ(e.peer_site(), "alpha");
  EXPECT_EQ(e.peer_fingerprint(), certificate_fingerprint(site_cert_path(other_, "alpha")));
  expect_client_told_refused(r.client.get(), "peer refused our certificate");
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, ServerCertificateFromAnotherCaIsRefusedByTheClient) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta", other_, main_), "beta");
  auto e = expect_refused(r.client_error, "certificate signed by an unknown CA");
  EXPECT_EQ(e.peer_fingerprint(), certificate_fingerprint(site_cert_path(other_, "beta")));
  EXPECT_EQ(e.peer(), "beta");
  expect_refused(r.server_error, "peer refused our certificate");
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, ExpiredClientCertificateIsRefused) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("expired"), ctx("beta"), "beta");
  auto e = expect_refused(r.server_error, "certificate expired");
  EXPECT_EQ(e.peer_site(), "expired");
  expect_client_told_refused(r.client.get(), "peer refused our certificate: expired");
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, NotYetValidClientCertificateIsRefused) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("future"), ctx("beta"), "beta");
  expect_refused(r.server_error, "not yet valid");
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, ExpiredServerCertificateIsRefusedByTheClient) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("expired"), "expired");
  expect_refused(r.client_error, "certificate expired");
  expect_refused(r.server_error, "peer refused our certificate: expired");
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, WrongSiteNameIsRefusedByTheClient) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("gamma"), "beta");
  auto e = expect_refused(r.client_error, "peer certificate names site 'gamma', expected 'beta'");
  EXPECT_EQ(e.peer_site(), "gamma");
  // The client aborted inside the handshake, so the server is told too.
  ASSERT_TRUE(r.server_error);
  EXPECT_THROW(std::rethrow_exception(r.server_error), AuthError);
  expect_good_peer(listener);
}

// The identity is the certificate's urn:nebula SAN, on both sides: a site name that is no DNS
// name works the same.
TEST_F(TlsLinkTest, SiteWithoutDnsNameMatchesByItsIdentity) {
  std::string dir = root_ + "/cn_only";
  fs::create_directories(dir);
  fs::copy_file(ca_cert_path(main_), ca_cert_path(dir));
  fs::copy_file(ca_key_path(main_), ca_key_path(dir));
  issue_site_certificate(dir, "site_b", "job-1");
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("site_b", dir), "site_b");
  ASSERT_FALSE(r.client_error || r.server_error);
  EXPECT_EQ(r.client->peer_identity(), "site_b");
}

// A certificate from the same CA but for another job is refused by the client (the server's)...
TEST_F(TlsLinkTest, ServerCertificateOfAnotherJobIsRefusedByTheClient) {
  TcpListener listener("127.0.0.1", 0);
  auto r = handshake(listener, ctx("alpha"), ctx("beta", job2_, main_), "beta");
  auto e = expect_refused(r.client_error, "peer certificate is for site 'beta' of job 'job-2', but this is job 'job-1'");
  EXPECT_EQ(e.peer_site(), "beta");
  ASSERT_TRUE(r.server_error);
  expect_good_peer(listener);
}

// An in-process OpenSSL client without a certificate.
TEST_F(TlsLinkTest, ClientWithoutCertificateIsRefused) {
  TcpListener listener("127.0.0.1", 0);
  auto server = std::async(std::launch::async, [&] {
    Deadline dl = Deadline::after(10s);
    return TlsLink::server(listener.accept(dl), ctx("beta"), dl);
  });
  auto client = std::async(std::launch::async, [&] {
    // OpenSSL's own socket BIO may raise SIGPIPE: keep it pending on this thread only.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    int fd = raw_connect(listener.port());
    timeval tv{5, 0};  // bounds every blocking read below
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    SSL_CTX* c = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION);
    SSL_CTX_load_verify_locations(c, ca_cert_path(main_).c_str(), nullptr);
    SSL_CTX_set_verify(c, SSL_VERIFY_PEER, nullptr);
    SSL* ssl = SSL_new(c);
    SSL_set_fd(ssl, fd);
    int connected = SSL_connect(ssl);
    char buf[16];
    int read = SSL_read(ssl, buf, sizeof buf);  // the server's refusal arrives here in TLS 1.3
    SSL_free(ssl);
    SSL_CTX_free(c);
    ERR_clear_error();
    ::close(fd);
    return std::make_pair(connected, read);
  });
  std::exception_ptr error;
  try {
    server.get();
  } catch (...) {
    error = std::current_exception();
  }
  auto [connected, read] = client.get();
  EXPECT_EQ(connected, 1);  // the client's side of a TLS 1.3 handshake completes first
  EXPECT_LE(read, 0);
  auto e = expect_refused(error, "peer sent no certificate");
  EXPECT_EQ(e.peer_fingerprint(), "");
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, PlaintextClientIsNotSpeakingTls) {
  TcpListener listener("127.0.0.1", 0);
  auto server = std::async(std::launch::async, [&] {
    Deadline dl = Deadline::after(10s);
    return TlsLink::server(listener.accept(dl), ctx("beta"), dl);
  });
  auto plain = TcpLink::connect("127.0.0.1", listener.port(), "beta", Deadline::after(5s));
  plain->send(make_frame(FrameType::kHello, 1, 0, pattern(64)), Deadline::after(5s));
  std::exception_ptr error;
  try {
    server.get();
  } catch (...) {
    error = std::current_exception();
  }
  auto e = expect_refused(error, "peer is not speaking TLS (plaintext or garbage)");
  EXPECT_NE(std::string(e.what()).find("plaintext nebula frame"), std::string::npos) << e.what();
  // The plaintext peer sees the connection end, not a hang.
  EXPECT_THROW(plain->recv(Deadline::after(5s)), PeerLost);
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, GarbageIsNotSpeakingTls) {
  TcpListener listener("127.0.0.1", 0);
  const std::vector<std::string> garbage = {
      std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
      std::string("\x00\x01\x02\x03\xff\xfe\xfd", 7),
      // Looks like a TLS handshake record header, then nonsense: OpenSSL has to judge it.
      std::string("\x16\x03\x01\x00\x10", 5) + std::string(16, '\xee'),
      std::string("\x16\x07\x07\x00\x10", 5) + std::string(16, '\x01'),
  };
  for (const auto& bytes : garbage) {
    auto server = std::async(std::launch::async, [&] {
      Deadline dl = Deadline::after(10s);
      return TlsLink::server(listener.accept(dl), ctx("beta"), dl);
    });
    int fd = raw_connect(listener.port());
    ASSERT_GE(fd, 0);
    raw_write(fd, bytes.data(), bytes.size());
    std::exception_ptr error;
    try {
      server.get();
    } catch (...) {
      error = std::current_exception();
    }
    ::close(fd);
    expect_refused(error, "peer is not speaking TLS");
  }
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, TlsClientToPlaintextServerIsNotSpeakingTls) {
  TcpListener listener("127.0.0.1", 0);
  auto plain_server = std::async(std::launch::async, [&] {
    auto link = listener.accept(Deadline::after(10s));
    link->send(make_frame(FrameType::kHello, 1, 0, pattern(64)), Deadline::after(5s));
    try {
      link->recv(Deadline::after(5s));  // the ClientHello is not a frame
    } catch (const Error&) {
    }
  });
  std::exception_ptr error;
  try {
    Deadline dl = Deadline::after(10s);
    TlsLink::client(TcpLink::connect("127.0.0.1", listener.port(), "beta", dl), ctx("alpha"), "beta", dl);
  } catch (...) {
    error = std::current_exception();
  }
  plain_server.get();
  expect_refused(error, "peer is not speaking TLS");
}

TEST_F(TlsLinkTest, SilentPeerTimesOutTheHandshake) {
  TcpListener listener("127.0.0.1", 0);
  // Server side: a client that connects and says nothing.
  int fd = raw_connect(listener.port());
  ASSERT_GE(fd, 0);
  auto tcp = listener.accept(Deadline::after(5s));
  try {
    TlsLink::server(std::move(tcp), ctx("beta"), Deadline::after(300ms));
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("handshake timed out"), std::string::npos) << e.what();
  }
  ::close(fd);
  // Client side: a server that accepts and never answers the ClientHello.
  auto client_tcp = TcpLink::connect("127.0.0.1", listener.port(), "beta", Deadline::after(5s));
  auto silent = listener.accept(Deadline::after(5s));
  try {
    TlsLink::client(std::move(client_tcp), ctx("alpha"), "beta", Deadline::after(300ms));
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("handshake timed out"), std::string::npos) << e.what();
  }
  silent.reset();
  expect_good_peer(listener);
}

TEST_F(TlsLinkTest, ContextErrorsNameTheFileAndTheFix) {
  auto expect_error = [](const TlsFiles& files, const std::string& file, const std::string& needle) {
    try {
      TlsContext::create(files);
      ADD_FAILURE() << "expected nebula::Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  TlsFiles good = TlsFiles::for_site(main_, "alpha");
  EXPECT_EQ(TlsContext::create(good)->name(), "alpha");
  EXPECT_EQ(TlsContext::create(good)->fingerprint(), certificate_fingerprint(good.cert));

  TlsFiles missing = good;
  missing.cert = main_ + "/nobody.pem";
  expect_error(missing, missing.cert, "nebula certs issue");

  TlsFiles mismatched = good;
  mismatched.key = site_key_path(main_, "beta");
  expect_error(mismatched, mismatched.key, "does not match");

  std::string junk = root_ + "/junk.pem";
  std::ofstream(junk) << "not a certificate\n";
  TlsFiles bad_cert = good;
  bad_cert.cert = junk;
  expect_error(bad_cert, junk, "cannot load");
  TlsFiles bad_ca = good;
  bad_ca.ca = junk;
  expect_error(bad_ca, junk, "nebula certs init");
}

// ---------------------------------------------------------------------------------------
// Interop with the real openssl command-line tool.

bool have_openssl_cli() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((dir + "/openssl").c_str(), X_OK) == 0) return true;
  return false;
}

// `timeout 20 openssl ARGS...` with a pipe as stdin and its output in `log`; killed by pid
// when this object goes.
class OpensslProcess {
 public:
  OpensslProcess(const std::vector<std::string>& args, std::string log) : log_(std::move(log)) {
    std::vector<std::string> all = {"timeout", "20", "openssl"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    int out = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(p[0], 0);
      ::dup2(out, 1);
      ::dup2(out, 2);
      ::execvp("timeout", argv.data());
      ::_exit(127);
    }
    ::close(p[0]);
    ::close(out);
    stdin_ = p[1];
  }
  ~OpensslProcess() {
    if (stdin_ >= 0) ::close(stdin_);
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 500; ++i) {  // at most 5 s, then SIGKILL
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
      std::this_thread::sleep_for(10ms);
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  void write_stdin(const std::vector<uint8_t>& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t r = ::write(stdin_, bytes.data() + done, bytes.size() - done);
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
  }
  std::string output() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int stdin_ = -1;
};

TEST_F(TlsLinkTest, InteropOurClientWithOpensslServer) {
  if (!have_openssl_cli()) GTEST_SKIP() << "no openssl binary on PATH";
  const uint16_t port = pick_free_port("127.0.0.1");
  OpensslProcess server({"s_server", "-accept", "127.0.0.1:" + std::to_string(port), "-cert",
                         site_cert_path(main_, "gamma"), "-key", site_key_path(main_, "gamma"), "-CAfile",
                         ca_cert_path(main_), "-Verify", "1", "-verify_return_error", "-tls1_3", "-naccept", "1"},
                        root_ + "/s_server.log");
  std::unique_ptr<TlsLink> link;
  try {
    Deadline dl = Deadline::after(15s);  // connect() retries until s_server listens
    link = TlsLink::client(TcpLink::connect("127.0.0.1", port, "gamma", dl), ctx("alpha"), "gamma", dl);
  } catch (const std::exception& e) {
    FAIL() << e.what() << "\ns_server output:\n" << server.output();
  }
  EXPECT_EQ(link->peer_identity(), "gamma");
  EXPECT_EQ(link->peer_fingerprint(), certificate_fingerprint(site_cert_path(main_, "gamma")));
  // s_server sends what it reads on stdin: a frame typed into it arrives intact, so
  // s_server accepted our certificate and records flow both ways.
  Frame f = make_frame(FrameType::kData, 5, 6, pattern(3000, 9));
  server.write_stdin(wire::encode_frame(f));
  Frame got;
  try {
    got = link->recv(Deadline::after(10s));
  } catch (const std::exception& e) {
    FAIL() << e.what() << "\ns_server output:\n" << server.output();
  }
  EXPECT_EQ(got.header.op_id, 5u);
  EXPECT_TRUE(got.payload == f.payload);
  link->send(make_frame(FrameType::kBye, 0, 0, {}), Deadline::after(5s));
}

TEST_F(TlsLinkTest, InteropOpensslClientWithOurServer) {
  if (!have_openssl_cli()) GTEST_SKIP() << "no openssl binary on PATH";
  TcpListener listener("127.0.0.1", 0);
  const std::string connect = "127.0.0.1:" + std::to_string(listener.port());
  {
    OpensslProcess client({"s_client", "-connect", connect, "-cert", site_cert_path(main_, "alpha"), "-key",
                           site_key_path(main_, "alpha"), "-CAfile", ca_cert_path(main_), "-verify_return_error",
                           "-tls1_3", "-quiet"},
                          root_ + "/s_client.log");
    std::unique_ptr<TlsLink> link;
    try {
      Deadline dl = Deadline::after(15s);
      link = TlsLink::server(listener.accept(dl), ctx("beta"), dl);
    } catch (const std::exception& e) {
      FAIL() << e.what() << "\ns_client output:\n" << client.output();
    }
    EXPECT_EQ(link->peer_identity(), "alpha");
    EXPECT_EQ(link->peer_fingerprint(), certificate_fingerprint(site_cert_path(main_, "alpha")));
    // s_client sends its stdin to us: a frame arrives intact.
    Frame f = make_frame(FrameType::kData, 8, 9, pattern(5000, 3));
    client.write_stdin(wire::encode_frame(f));
    Frame got;
    try {
      got = link->recv(Deadline::after(10s));
    } catch (const std::exception& e) {
      FAIL() << e.what() << "\ns_client output:\n" << client.output();
    }
    EXPECT_EQ(got.header.seq, 9u);
    EXPECT_TRUE(got.payload == f.payload) << client.output();
  }
  {
    // Without -cert: refused, with the reason.
    OpensslProcess client({"s_client", "-connect", connect, "-CAfile", ca_cert_path(main_), "-tls1_3"},
                          root_ + "/s_client_nocert.log");
    std::exception_ptr error;
    try {
      Deadline dl = Deadline::after(15s);
      TlsLink::server(listener.accept(dl), ctx("beta"), dl);
    } catch (...) {
      error = std::current_exception();
    }
    expect_refused(error, "no certificate");
  }
  expect_good_peer(listener);
}

// ...and by the server (the client's), with a client that checks nothing itself.
TEST_F(TlsLinkTest, ClientCertificateOfAnotherJobIsRefusedByTheServer) {
  if (!have_openssl_cli()) GTEST_SKIP() << "no openssl binary on PATH";
  TcpListener listener("127.0.0.1", 0);
  const std::string connect = "127.0.0.1:" + std::to_string(listener.port());
  OpensslProcess client({"s_client", "-connect", connect, "-cert", site_cert_path(job2_, "alpha"), "-key",
                         site_key_path(job2_, "alpha"), "-tls1_3", "-quiet"},
                        root_ + "/s_client_job2.log");
  std::exception_ptr error;
  try {
    Deadline dl = Deadline::after(15s);
    TlsLink::server(listener.accept(dl), ctx("beta"), dl);
  } catch (...) {
    error = std::current_exception();
  }
  auto e = expect_refused(error, "peer certificate is for site 'alpha' of job 'job-2', but this is job 'job-1'");
  EXPECT_EQ(e.peer_fingerprint(), certificate_fingerprint(site_cert_path(job2_, "alpha")));
  expect_good_peer(listener);
}

}  // namespace
}  // namespace nebula::transport
