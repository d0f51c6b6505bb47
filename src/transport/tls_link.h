// TlsLink: a TcpLink whose bytes go through TLS 1.3 with mutual certificate
// authentication (DESIGN.md, "Security"), and TlsContext, the shared OpenSSL settings.
//
// Like gloo's TLS pair (gloo/transport/tcp/tls/pair.h) TlsLink IS the TCP link with its
// byte-level primitives overridden: read_some()/write_some() call SSL_read/SSL_write on
// the same non-blocking socket, and TcpLink's framing code -- header validation before
// allocation, CRC, deadlines, the broken-link state, thread-safety contract -- runs
// unchanged on top. See tcp_link.h and link.h.
//
// Usage (a gateway):
//   auto ctx = TlsContext::create(TlsFiles::for_site("certs", "alpha"));
//   // client: the config says site "beta" is at this address
//   auto link = TlsLink::client(TcpLink::connect(host, port, "beta", dl), ctx, "beta", dl);
//   // server: the layer above then checks that the site the peer claims in its hello
//   // frame equals link->peer_identity()
//   auto link = TlsLink::server(listener.accept(dl), ctx, dl);
//
// Ownership of the socket: client()/server() take the TcpLink by unique_ptr and take its
// descriptor over (TcpLink's protected constructor); the TcpLink object is gone afterwards.
// Whether the handshake succeeds or throws, the caller no longer owns anything of it; on
// failure the socket is closed. A failed handshake touches no other link or the listener.
//
// Handshake failures. TlsLink::client()/server() throw
//   * TlsHandshakeError (an AuthError) for every refusal, with reason() one of
//       "certificate signed by an unknown CA (...)"     the peer's chain does not reach our CA
//       "certificate expired (notAfter ...)"            the peer's certificate is expired
//       "certificate not yet valid (notBefore ...)"
//       "peer certificate names site 'x', expected 'y'" client side, wrong site
//       "peer certificate is for site 'x' of job 'j', but this is job 'k'"
//       "peer certificate (CN 'x'): the certificate names no nebula job and site ..."
//       "peer sent no certificate"                      server side, client without certificate
//       "peer is not speaking TLS (plaintext or garbage)..."
//       "peer refused our certificate: ..."             the peer sent a certificate alert
//       "peer closed the connection during the handshake" and a few rarer ones;
//     peer_site()/peer_fingerprint() describe the certificate the peer presented, if any,
//     so a refusal can be audited with the fingerprint;
//   * nebula::Timeout when the Deadline passes first (audit reason "handshake timed out",
//     outcome "failed").
// Note on TLS 1.3: the client finishes its side of the handshake before the server has
// checked the client's certificate. A client whose certificate the server refuses
// therefore learns it on its first recv() (or send()), which throws AuthError
// "... peer refused our certificate: <alert>" and breaks the link.
//
// Timeouts: as for TcpLink (link.h), except that a send() whose deadline passes while the
// socket buffer is full always breaks the link, even if no byte of the frame was reported
// sent: OpenSSL then already holds an encrypted record of the frame, so sending another
// frame next would put the stream out of step. A recv() timeout leaves the link usable
// (a partly received record stays buffered inside OpenSSL).
//
// Byte counters (stats()) count frame bytes (plaintext), like TcpLink's; the wire counters
// count what went through the socket: TLS records, the handshake included.
// close() shuts the socket down, waking blocked calls (no close_notify is sent: peers treat
// a bare EOF between frames as an orderly close). No SIGPIPE: the socket is written with
// send(MSG_NOSIGNAL) through a small custom OpenSSL BIO.
//
// Thread safety: as for every Link. OpenSSL forbids concurrent calls on one SSL object, so
// each SSL_read/SSL_write (non-blocking, short) runs under ssl_mu_; waiting in poll()
// happens outside it, so a blocked recv() never holds up send(). TlsContext is immutable
// after create() and shared by any number of links and threads.
#pragma once

#include <openssl/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/tcp_link.h"

namespace nebula::transport {

struct TlsSocketBio;  // tls_link.cc: the state of TlsLink's socket BIO

// PEM file paths of one site's TLS identity.
struct TlsFiles {
  std::string ca;    // the site CA certificate every site trusts (ca.pem)
  std::string cert;  // this site's certificate (<site>.pem)
  std::string key;   // this site's private key (<site>.key)
  // The files `nebula certs` writes in `dir` for `site` (see certs.h).
  static TlsFiles for_site(const std::string& dir, const std::string& site);
};

class TlsContext {
 public:
  // Loads and checks the three files: TLS 1.3 only; peers must present a certificate
  // that chains to `files.ca` and is valid now (both sides: mutual authentication); the
  // key must match the certificate. Throws nebula::Error naming the file, the OpenSSL
  // reason, and what to do (e.g. "run `nebula certs issue DIR --site NAME`"). A
  // certificate that is itself expired, not yet valid or not issued by the CA only logs a
  // warning (peers will refuse it, with a clear reason on their side).
  static std::shared_ptr<TlsContext> create(const TlsFiles& files);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  // Our site and job (the certificate's identity, certs.h) and the SHA-256 hex fingerprint of
  // our certificate. Peers must present a certificate of the same job.
  const std::string& name() const { return name_; }
  const std::string& job() const { return job_; }
  const std::string& fingerprint() const { return fingerprint_; }
  const TlsFiles& files() const { return files_; }

  SSL_CTX* native() const { return ctx_; }

 private:
  TlsContext() = default;
  SSL_CTX* ctx_ = nullptr;
  TlsFiles files_;
  std::string name_, job_, fingerprint_;
};

// A refused TLS handshake (see the top of this file for the reasons).
class TlsHandshakeError : public AuthError {
 public:
  TlsHandshakeError(std::string peer, const std::string& message, std::string reason, std::string peer_site,
                    std::string peer_fingerprint)
      : AuthError(std::move(peer), message),
        reason_(std::move(reason)),
        peer_site_(std::move(peer_site)),
        peer_fingerprint_(std::move(peer_fingerprint)) {}
  // Short human reason, for the audit log.
  const std::string& reason() const { return reason_; }
  // CN and SHA-256 hex of the certificate the peer presented; "" if none was seen.
  const std::string& peer_site() const { return peer_site_; }
  const std::string& peer_fingerprint() const { return peer_fingerprint_; }

 private:
  std::string reason_, peer_site_, peer_fingerprint_;
};

class TlsLink : public TcpLink {
 public:
  // Handshakes as the TLS client on `tcp`'s socket. Besides the chain and validity checks,
  // the server's certificate must name `expected_site` (as its CN or a subjectAltName DNS
  // entry); otherwise the handshake is aborted with an alert and TlsHandshakeError
  // "peer certificate names site 'gamma', expected 'beta'". Bounded by `deadline`.
  static std::unique_ptr<TlsLink> client(std::unique_ptr<TcpLink> tcp, std::shared_ptr<TlsContext> ctx,
                                         const std::string& expected_site, Deadline deadline);

  // Handshakes as the TLS server. Any client whose certificate chains to the CA and is
  // valid now is accepted here; the layer above must check that the site the peer claims
  // equals peer_identity(). Before handing bytes to OpenSSL it peeks at the first byte, so
  // a plaintext nebula peer or other garbage is refused as "not speaking TLS" at once.
  static std::unique_ptr<TlsLink> server(std::unique_ptr<TcpLink> tcp, std::shared_ptr<TlsContext> ctx,
                                         Deadline deadline);

  ~TlsLink() override;

  LinkStats stats() const override;
  // The peer certificate's site (its identity, certs.h) and SHA-256 hex fingerprint; set by
  // the handshake, constant afterwards.
  std::string peer_identity() const override { return peer_identity_; }
  std::string peer_fingerprint() const override { return peer_fingerprint_; }
  const TlsContext& context() const { return *ctx_; }

  // What the certificate verify callback saw during the handshake (internal; public only
  // so the C callback can reach it).
  struct VerifyState {
    std::string expected_job;   // both sides: our job (TlsContext::job())
    std::string expected_site;  // client side: the site the server must be
    std::string leaf_site, leaf_fingerprint, leaf_not_before, leaf_not_after;
    int error = 0;              // first X509_V_ERR_* seen, 0 if none
    std::string identity_error;  // the leaf's identity is missing or not the expected one
  };

 protected:
  IoResult read_some(uint8_t* p, size_t n) override;
  IoResult write_some(const iovec* iov, int iovcnt) override;

 private:
  TlsLink(std::unique_ptr<TcpLink> tcp, std::shared_ptr<TlsContext> ctx, bool is_server);
  void handshake(Deadline deadline);
  void expect_client_hello(Deadline deadline);
  [[noreturn]] void refuse(const std::string& reason, const std::string& advice);
  [[noreturn]] void handshake_timeout(const std::string& detail);
  // Maps a failed SSL_read/SSL_write (SSL_get_error code `err`) to an IoResult. Called
  // with ssl_mu_ held, before anything else touches this thread's OpenSSL error queue.
  IoResult io_failure(int err);

  const std::shared_ptr<TlsContext> ctx_;
  const bool is_server_;
  const Clock::time_point start_;
  std::mutex ssl_mu_;       // held for every call on ssl_ (OpenSSL forbids concurrent ones)
  SSL* ssl_ = nullptr;      // GUARDED_BY(ssl_mu_) after the handshake
  TlsSocketBio* bio_ = nullptr;  // owned by ssl_'s BIO; GUARDED_BY(ssl_mu_)
  VerifyState verify_;      // written by the verify callback during the handshake only
  std::string peer_identity_, peer_fingerprint_;  // set by the handshake, then constant
  std::vector<uint8_t> staging_;  // write_some()'s coalescing buffer; used under the send lock
};

}  // namespace nebula::transport
