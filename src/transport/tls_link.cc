#include "transport/tls_link.h"

#include <poll.h>
#include <sys/socket.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "transport/certs.h"

namespace nebula::transport {

// The state behind TlsLink's BIO: OpenSSL's own socket BIO writes with write(2), which
// raises SIGPIPE on a dead peer; this one uses send(MSG_NOSIGNAL), and keeps the errno
// of its last failure for the error message.
struct TlsSocketBio {
  int fd;
  int last_errno = 0;
  bool eof = false;
  // Bytes on the socket (TLS records), for stats(): written under ssl_mu_, read by any thread.
  std::atomic<uint64_t> sent{0}, received{0};
};

namespace {

// TLS records carry at most 16 KiB of plaintext; small writes are coalesced up to this.
constexpr size_t kRecordPayload = 16 * 1024;
// One SSL_read/SSL_write moves at most this much (OpenSSL handles one record per call
// anyway, SSL_MODE_ENABLE_PARTIAL_WRITE); keeps lengths well inside int.
constexpr size_t kMaxIo = 1 << 20;

int bio_write(BIO* b, const char* data, int len) {
  auto* s = static_cast<TlsSocketBio*>(BIO_get_data(b));
  BIO_clear_retry_flags(b);
  for (;;) {
    ssize_t r = ::send(s->fd, data, static_cast<size_t>(len), MSG_NOSIGNAL);
    if (r >= 0) {
      s->sent.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
      return static_cast<int>(r);
    }
    if (errno == EINTR) continue;
    s->last_errno = errno;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_write(b);
    return -1;
  }
}

int bio_read(BIO* b, char* out, int len) {
  auto* s = static_cast<TlsSocketBio*>(BIO_get_data(b));
  BIO_clear_retry_flags(b);
  for (;;) {
    ssize_t r = ::recv(s->fd, out, static_cast<size_t>(len), 0);
    if (r > 0) {
      s->received.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
      return static_cast<int>(r);
    }
    if (r == 0) {
      s->eof = true;
      return 0;
    }
    if (errno == EINTR) continue;
    s->last_errno = errno;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_read(b);
    return -1;
  }
}

long bio_ctrl(BIO* b, int cmd, long, void*) {
  auto* s = static_cast<TlsSocketBio*>(BIO_get_data(b));
  switch (cmd) {
    case BIO_CTRL_FLUSH:
      return 1;  // nothing is buffered here
    case BIO_CTRL_EOF:
      return s && s->eof ? 1 : 0;  // lets OpenSSL report "unexpected eof" precisely
    default:
      return 0;
  }
}

int bio_create(BIO* b) {
  BIO_set_init(b, 1);
  return 1;
}

int bio_destroy(BIO* b) {
  delete static_cast<TlsSocketBio*>(BIO_get_data(b));
  BIO_set_data(b, nullptr);
  return 1;
}

BIO_METHOD* socket_bio_method() {
  static BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR, "nebula socket");
    if (!m || !BIO_meth_set_write(m, bio_write) || !BIO_meth_set_read(m, bio_read) ||
        !BIO_meth_set_ctrl(m, bio_ctrl) || !BIO_meth_set_create(m, bio_create) ||
        !BIO_meth_set_destroy(m, bio_destroy))
      throw Error(str_cat("cannot create the OpenSSL socket BIO method: ", openssl_error_text()));
    return m;  // lives as long as the process
  }();
  return method;
}

// SSL ex_data slot holding the TlsLink::VerifyState of a connection.
int verify_state_index() {
  static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

// Runs for every certificate of the peer's chain (ok = OpenSSL's verdict so far). Records
// what the peer presented (for messages and the audit log), the first error, and rejects a
// leaf whose identity (x509_identity, the one rule on both sides) is missing, of another
// job, or -- on the client side -- of another site than expected: inside the handshake, so
// the peer receives an alert rather than a finished handshake.
int verify_callback(int ok, X509_STORE_CTX* store) {
  SSL* ssl = static_cast<SSL*>(X509_STORE_CTX_get_ex_data(store, SSL_get_ex_data_X509_STORE_CTX_idx()));
  auto* st = ssl ? static_cast<TlsLink::VerifyState*>(SSL_get_ex_data(ssl, verify_state_index())) : nullptr;
  if (!st) return ok;
  X509* leaf = X509_STORE_CTX_get0_cert(store);
  if (leaf && st->leaf_fingerprint.empty()) {
    try {
      st->leaf_fingerprint = x509_fingerprint(leaf);
    } catch (const Error&) {
    }
    const CertIdentity id = x509_identity(leaf);
    st->leaf_site = id.ok() ? id.site : x509_common_name(leaf);
    st->leaf_not_before = x509_not_before(leaf);
    st->leaf_not_after = x509_not_after(leaf);
  }
  if (!ok) {
    if (st->error == 0) st->error = X509_STORE_CTX_get_error(store);
    return 0;
  }
  if (X509_STORE_CTX_get_error_depth(store) == 0 && X509_STORE_CTX_get_current_cert(store) == leaf) {
    const CertIdentity id = x509_identity(leaf);
    if (!id.ok())
      st->identity_error = str_cat("peer certificate (CN '", x509_common_name(leaf), "'): ", id.problem);
    else if (id.job != st->expected_job)
      st->identity_error = str_cat("peer certificate is for site '", id.site, "' of job '", id.job,
                                   "', but this is job '", st->expected_job, "'");
    else if (!st->expected_site.empty() && id.site != st->expected_site)
      st->identity_error = str_cat("peer certificate names site '", id.site, "', expected '", st->expected_site, "'");
    if (!st->identity_error.empty()) {
      st->error = X509_V_ERR_HOSTNAME_MISMATCH;
      X509_STORE_CTX_set_error(store, X509_V_ERR_HOSTNAME_MISMATCH);
      return 0;
    }
  }
  return ok;
}

bool unknown_ca_error(long code) {
  switch (code) {
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT:
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
    case X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE:
    case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
    case X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN:
    case X509_V_ERR_CERT_SIGNATURE_FAILURE:
    case X509_V_ERR_UNABLE_TO_DECRYPT_CERT_SIGNATURE:
      return true;
    default:
      return false;
  }
}

bool not_tls_reason(int reason) {
  switch (reason) {
    case SSL_R_WRONG_VERSION_NUMBER:
    case SSL_R_HTTP_REQUEST:
    case SSL_R_HTTPS_PROXY_REQUEST:
    case SSL_R_PACKET_LENGTH_TOO_LONG:
    case SSL_R_ENCRYPTED_LENGTH_TOO_LONG:
    case SSL_R_UNKNOWN_PROTOCOL:
    case SSL_R_BAD_PACKET_LENGTH:
    case SSL_R_LENGTH_TOO_SHORT:
    case SSL_R_RECORD_LENGTH_MISMATCH:
    case SSL_R_BAD_RECORD_TYPE:
    case SSL_R_UNEXPECTED_RECORD:
      return true;
    default:
      return false;
  }
}

bool is_alert_reason(int reason) { return reason >= SSL_AD_REASON_OFFSET && reason < SSL_AD_REASON_OFFSET + 256; }

bool certificate_alert(int alert) {
  switch (alert) {
    case SSL_AD_BAD_CERTIFICATE:
    case SSL_AD_UNSUPPORTED_CERTIFICATE:
    case SSL_AD_CERTIFICATE_REVOKED:
    case SSL_AD_CERTIFICATE_EXPIRED:
    case SSL_AD_CERTIFICATE_UNKNOWN:
    case SSL_AD_UNKNOWN_CA:
    case SSL_AD_ACCESS_DENIED:
    case SSL_AD_CERTIFICATE_REQUIRED:
      return true;
    default:
      return false;
  }
}

std::string alert_text(int alert) { return str_cat("TLS alert '", SSL_alert_desc_string_long(alert), "'"); }

// The reason when the peer told us, with an alert, that it refused our certificate.
std::string refused_our_certificate(int alert) {
  switch (alert) {
    case SSL_AD_UNKNOWN_CA:
      return str_cat("peer refused our certificate: it does not trust the CA that signed it (", alert_text(alert), ")");
    case SSL_AD_CERTIFICATE_EXPIRED:
      return str_cat("peer refused our certificate: expired (", alert_text(alert), ")");
    case SSL_AD_CERTIFICATE_REQUIRED:
      return str_cat("peer refused us: it requires a client certificate (", alert_text(alert), ")");
    default:
      return str_cat("peer refused our certificate (", alert_text(alert),
                     ": e.g. not yet valid, or not the site it expects)");
  }
}

// Text for the first bytes a non-TLS peer sent.
std::string describe_first_bytes(const unsigned char* b, size_t n) {
  if (n >= 4 && b[0] == 0x4C && b[1] == 0x55 && b[2] == 0x42 && b[3] == 0x4E)
    return "it sent a plaintext nebula frame: is it configured with insecure = true?";
  bool text = std::all_of(b, b + n, [](unsigned char c) { return std::isprint(c) || c == '\r' || c == '\n'; });
  if (text) {
    std::string s(reinterpret_cast<const char*>(b), n);
    for (char& c : s)
      if (c == '\r' || c == '\n') c = ' ';
    return str_cat("it sent text starting \"", s, "\"");
  }
  std::string hex;
  for (size_t i = 0; i < n; ++i) {
    char buf[4];
    std::snprintf(buf, sizeof buf, "%s%02x", i ? " " : "", b[i]);
    hex += buf;
  }
  return str_cat("its first bytes are ", hex, ", not a TLS handshake record");
}

std::string ms_text(Clock::time_point start) {
  return str_cat(static_cast<long long>(std::chrono::duration<double, std::milli>(Clock::now() - start).count()),
                 " ms");
}

struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};

}  // namespace

// ---------------------------------------------------------------------------------------

TlsFiles TlsFiles::for_site(const std::string& dir, const std::string& site) {
  return {ca_cert_path(dir), site_cert_path(dir, site), site_key_path(dir, site)};
}

std::shared_ptr<TlsContext> TlsContext::create(const TlsFiles& files) {
  const std::string issue_hint =
      "run `nebula certs issue DIR --site NAME --job JOB` to issue a site certificate and key";
  const std::string ca_hint = "copy the site CA certificate (ca.pem, made by `nebula certs init DIR`) there";
  auto require = [](const std::string& what, const std::string& path, const std::string& hint) {
    if (path.empty()) throw Error(str_cat("TLS ", what, ": no file configured; ", hint));
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
      throw Error(str_cat("TLS ", what, " ", path, ": no such file; ", hint));
  };
  require("certificate", files.cert, issue_hint);
  require("private key", files.key, issue_hint);
  require("CA certificate", files.ca, ca_hint);

  ERR_clear_error();
  std::unique_ptr<SSL_CTX, SslCtxFree> ctx(SSL_CTX_new(TLS_method()));
  if (!ctx) throw Error(str_cat("SSL_CTX_new failed: ", openssl_error_text()));
  // TLS 1.3 only: no downgrade, no renegotiation, forward secrecy always.
  if (SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(ctx.get(), TLS1_3_VERSION) != 1)
    throw Error(str_cat("cannot restrict TLS to version 1.3: ", openssl_error_text()));
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert.c_str()) != 1)
    throw Error(str_cat("TLS certificate ", files.cert, ": cannot load (", openssl_error_text(), "); ", issue_hint));
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key.c_str(), SSL_FILETYPE_PEM) != 1)
    throw Error(str_cat("TLS private key ", files.key, ": cannot load, or it does not match certificate ", files.cert,
                        " (", openssl_error_text(), "); ", issue_hint, " (it writes both together)"));
  if (SSL_CTX_check_private_key(ctx.get()) != 1)
    throw Error(str_cat("TLS private key ", files.key, " does not match certificate ", files.cert, " (",
                        openssl_error_text(), "); ", issue_hint, " (it writes both together)"));
  if (SSL_CTX_load_verify_locations(ctx.get(), files.ca.c_str(), nullptr) != 1)
    throw Error(str_cat("TLS CA certificate ", files.ca, ": cannot load (", openssl_error_text(), "); ", ca_hint));
  // Tell clients which CA we accept (openssl s_client shows it; harmless otherwise).
  if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.ca.c_str())) SSL_CTX_set_client_CA_list(ctx.get(), names);
  ERR_clear_error();

  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, verify_callback);
  // Partial writes: one record per SSL_write, so progress and deadlines work as for TCP.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Links are long-lived and reconnects rare: no session resumption, no tickets.
  SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_OFF);
  SSL_CTX_set_num_tickets(ctx.get(), 0);
  // AES-128-GCM first: as safe for this use and ~5% faster than AES-256 with AES-NI.
  SSL_CTX_set_ciphersuites(ctx.get(), "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256");

  auto out = std::shared_ptr<TlsContext>(new TlsContext());
  out->files_ = files;
  X509* own = SSL_CTX_get0_certificate(ctx.get());
  const CertIdentity id = x509_identity(own);
  if (!id.ok()) throw Error(str_cat("TLS certificate ", files.cert, ": ", id.problem, "; ", issue_hint));
  out->name_ = id.site;
  out->job_ = id.job;
  out->fingerprint_ = x509_fingerprint(own);

  // Our own certificate against our own CA: only a warning (tests, and a CA being rolled
  // out), but the usual misconfigurations are then named on this side too.
  if (X509_STORE_CTX* vctx = X509_STORE_CTX_new()) {
    if (X509_STORE_CTX_init(vctx, SSL_CTX_get_cert_store(ctx.get()), own, nullptr) == 1 &&
        X509_verify_cert(vctx) != 1) {
      spdlog::warn("TLS certificate {} (site {}) does not verify against CA {}: {}; peers will refuse it",
                   files.cert, out->name_, files.ca, X509_verify_cert_error_string(X509_STORE_CTX_get_error(vctx)));
    }
    X509_STORE_CTX_free(vctx);
  }
  ERR_clear_error();
  out->ctx_ = ctx.release();
  return out;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

// ---------------------------------------------------------------------------------------

TlsLink::TlsLink(std::unique_ptr<TcpLink> tcp, std::shared_ptr<TlsContext> ctx, bool is_server)
    : TcpLink(std::move(tcp)), ctx_(std::move(ctx)), is_server_(is_server), start_(Clock::now()) {
  ERR_clear_error();
  ssl_ = SSL_new(ctx_->native());
  if (!ssl_) throw Error(str_cat("SSL_new failed: ", openssl_error_text()));
  BIO* bio = BIO_new(socket_bio_method());
  if (!bio) {
    SSL_free(ssl_);
    throw Error(str_cat("BIO_new failed: ", openssl_error_text()));
  }
  bio_ = new TlsSocketBio{fd()};
  BIO_set_data(bio, bio_);
  SSL_set_bio(ssl_, bio, bio);  // ssl_ owns the BIO, the BIO owns bio_
  verify_.expected_job = ctx_->job();  // both sides: the peer must be of our job
  SSL_set_ex_data(ssl_, verify_state_index(), &verify_);
  if (is_server_)
    SSL_set_accept_state(ssl_);
  else
    SSL_set_connect_state(ssl_);
}

LinkStats TlsLink::stats() const {
  LinkStats s = TcpLink::stats();  // frames, plaintext
  s.wire_bytes_sent = bio_->sent.load(std::memory_order_relaxed);
  s.wire_bytes_received = bio_->received.load(std::memory_order_relaxed);
  return s;
}

TlsLink::~TlsLink() {
  close();  // shut the socket down first (TcpLink's destructor closes it after us)
  std::lock_guard<std::mutex> lock(ssl_mu_);
  SSL_free(ssl_);
}

std::unique_ptr<TlsLink> TlsLink::client(std::unique_ptr<TcpLink> tcp, std::shared_ptr<TlsContext> ctx,
                                         const std::string& expected_site, Deadline deadline) {
  NEBULA_CHECK(tcp != nullptr && ctx != nullptr, "TlsLink::client needs a connected TcpLink and a TlsContext");
  NEBULA_CHECK(!expected_site.empty(), "TlsLink::client to ", tcp->describe(), ": empty expected site name");
  std::unique_ptr<TlsLink> link(new TlsLink(std::move(tcp), std::move(ctx), /*is_server=*/false));
  link->verify_.expected_site = expected_site;
  link->handshake(deadline);
  return link;
}

std::unique_ptr<TlsLink> TlsLink::server(std::unique_ptr<TcpLink> tcp, std::shared_ptr<TlsContext> ctx,
                                         Deadline deadline) {
  NEBULA_CHECK(tcp != nullptr && ctx != nullptr, "TlsLink::server needs an accepted TcpLink and a TlsContext");
  std::unique_ptr<TlsLink> link(new TlsLink(std::move(tcp), std::move(ctx), /*is_server=*/true));
  link->expect_client_hello(deadline);
  link->handshake(deadline);
  return link;
}

void TlsLink::refuse(const std::string& reason, const std::string& advice) {
  std::string msg = str_cat("TLS handshake with ", describe(), " (we are ", is_server_ ? "server" : "client", ", site ",
                            ctx_->name(), "): ", reason);
  if (!advice.empty()) msg += "; " + advice;
  spdlog::warn("{}", msg);
  throw TlsHandshakeError(peer(), msg, reason, verify_.leaf_site, verify_.leaf_fingerprint);
}

void TlsLink::handshake_timeout(const std::string& detail) {
  std::string msg = str_cat("TLS handshake with ", describe(), " (we are ", is_server_ ? "server" : "client",
                            "): handshake timed out after ", ms_text(start_), detail.empty() ? "" : " (",
                            detail, detail.empty() ? "" : ")",
                            "; is the peer a nebula gateway speaking TLS, and does the deadline allow a few "
                            "WAN round trips?");
  spdlog::warn("{}", msg);
  throw Timeout(peer(), msg);
}

void TlsLink::expect_client_hello(Deadline deadline) {
  // Peek, do not read: the bytes stay for OpenSSL. A TLS client speaks first, with a
  // handshake record: content type 22, then major version 3.
  for (;;) {
    unsigned char b[8];
    ssize_t r = ::recv(fd(), b, sizeof b, MSG_PEEK);
    if (r > 0) {
      size_t n = static_cast<size_t>(r);
      if (b[0] == 0x16 && (n < 2 || b[1] == 0x03)) return;
      refuse("peer is not speaking TLS (plaintext or garbage)",
             str_cat(describe_first_bytes(b, n), " (or another service is using this address)"));
    }
    if (r == 0) refuse("peer closed the connection before the handshake", "");
    int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK)
      refuse(str_cat("connection failed before the handshake: ", std::strerror(err)), "");
    pollfd p{fd(), POLLIN, 0};
    int pr = ::poll(&p, 1, deadline.poll_timeout_ms());
    if (pr < 0 && errno != EINTR) refuse(str_cat("poll failed: ", std::strerror(errno)), "");
    if (pr == 0 && deadline.expired()) handshake_timeout("the peer sent nothing");
  }
}

void TlsLink::handshake(Deadline deadline) {
  for (;;) {
    int rc = 0, err = SSL_ERROR_NONE, sys_errno = 0;
    unsigned long first_error = 0;
    long verify_result = X509_V_OK;
    OSSL_HANDSHAKE_STATE state = TLS_ST_BEFORE;
    std::string detail;
    {
      std::lock_guard<std::mutex> lock(ssl_mu_);
      ERR_clear_error();
      bio_->last_errno = 0;
      rc = SSL_do_handshake(ssl_);
      if (rc == 1) {
        X509* cert = SSL_get0_peer_certificate(ssl_);
        if (!cert) break;  // handled below, outside the lock
        peer_identity_ = x509_identity(cert).site;  // checked by verify_callback
        peer_fingerprint_ = x509_fingerprint(cert);
        break;
      }
      err = SSL_get_error(ssl_, rc);
      first_error = ERR_peek_error();
      detail = openssl_error_text();
      verify_result = SSL_get_verify_result(ssl_);
      sys_errno = bio_->last_errno;
      state = SSL_get_state(ssl_);
    }
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      pollfd p{fd(), static_cast<short>(err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
      int pr = ::poll(&p, 1, deadline.poll_timeout_ms());
      if (pr < 0 && errno != EINTR) refuse(str_cat("poll failed: ", std::strerror(errno)), "");
      if (pr == 0 && deadline.expired()) handshake_timeout("");
      continue;
    }

    // Failed: name the case.
    const int reason = ERR_GET_LIB(first_error) == ERR_LIB_SSL ? ERR_GET_REASON(first_error) : 0;
    long code = verify_.error != 0 ? verify_.error : verify_result;
    const std::string ca = ctx_->files().ca;
    if (!verify_.identity_error.empty())
      refuse(verify_.identity_error,
             "check the config's gateway address for this site, or issue the peer's certificate for this job and "
             "site (`nebula certs issue DIR --site NAME --job JOB`)");
    if (code != X509_V_OK) {
      std::string why = X509_verify_cert_error_string(code);
      if (unknown_ca_error(code))
        refuse(str_cat("peer certificate signed by an unknown CA (", why, ")"),
               str_cat("every site must trust the same site CA (", ca,
                       "): issue the peer's certificate from it with `nebula certs issue`"));
      if (code == X509_V_ERR_CERT_HAS_EXPIRED)
        refuse(str_cat("peer certificate expired (notAfter ", verify_.leaf_not_after, ")"),
               "re-issue it with `nebula certs issue DIR --site NAME`");
      if (code == X509_V_ERR_CERT_NOT_YET_VALID)
        refuse(str_cat("peer certificate not yet valid (notBefore ", verify_.leaf_not_before, ")"),
               "check the clocks of both hosts");
      refuse(str_cat("peer certificate rejected (", why, ")"), "");
    }
    if (reason == SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE)
      refuse("peer sent no certificate", "configure the peer with its site certificate and key ([security] in the config)");
    if (is_alert_reason(reason)) {
      int alert = reason - SSL_AD_REASON_OFFSET;
      if (certificate_alert(alert))
        refuse(refused_our_certificate(alert),
               str_cat("check that our certificate ", ctx_->files().cert,
                       " was issued by the CA the peer trusts, is valid now, and names this site; see the peer's log"));
      if (alert == SSL_AD_PROTOCOL_VERSION) refuse("peer does not speak TLS 1.3 (" + alert_text(alert) + ")", "");
      refuse(str_cat("peer aborted the handshake (", alert_text(alert), ")"), "see the peer's log");
    }
    if (reason == SSL_R_UNSUPPORTED_PROTOCOL || reason == SSL_R_NO_PROTOCOLS_AVAILABLE ||
        reason == SSL_R_VERSION_TOO_LOW)
      refuse("peer does not speak TLS 1.3", detail);
    // A protocol error before the peer's first handshake message was understood (the
    // server still waiting for a ClientHello, the client for a ServerHello): what came
    // looked at most like a TLS record header.
    const bool before_first_message = is_server_ ? state == TLS_ST_BEFORE : state == TLS_ST_CW_CLNT_HELLO;
    if (not_tls_reason(reason) || (err == SSL_ERROR_SSL && reason != 0 && before_first_message))
      refuse("peer is not speaking TLS (plaintext or garbage)",
             str_cat("OpenSSL: ", detail, "; is the peer configured with insecure = true, or is another service "
                     "using this address?"));
    if (err == SSL_ERROR_ZERO_RETURN || reason == SSL_R_UNEXPECTED_EOF_WHILE_READING ||
        (err == SSL_ERROR_SYSCALL && sys_errno == 0))
      refuse("peer closed the connection during the handshake",
             "it may have refused our certificate or not speak TLS (insecure = true?); see the peer's log");
    if (err == SSL_ERROR_SYSCALL) {
      if (sys_errno == ECONNRESET || sys_errno == EPIPE)
        refuse("peer reset the connection during the handshake",
               "it may have refused our certificate or not speak TLS (insecure = true?); see the peer's log");
      refuse(str_cat("connection failed during the handshake: ", std::strerror(sys_errno)), "");
    }
    refuse(str_cat("TLS handshake failed (", detail, ")"), "");
  }
  if (peer_fingerprint_.empty()) refuse("peer sent no certificate", "");
  spdlog::debug("TLS link with {} up after {}: peer site {}, certificate {}", describe(), ms_text(start_),
                peer_identity_, peer_fingerprint_);
}

// ---------------------------------------------------------------------------------------

TcpLink::IoResult TlsLink::io_failure(int err) {
  switch (err) {
    case SSL_ERROR_WANT_READ:
      return IoResult::wait(POLLIN);
    case SSL_ERROR_WANT_WRITE:
      return IoResult::wait(POLLOUT);
    case SSL_ERROR_ZERO_RETURN:  // close_notify
      return IoResult::eof();
    case SSL_ERROR_SYSCALL: {
      int e = bio_->last_errno;
      ERR_clear_error();
      if (e == 0) return IoResult::eof();
      if (e == EPIPE || e == ECONNRESET)
        return IoResult::failed(str_cat("peer closed the connection (", std::strerror(e), ")"));
      return IoResult::failed(std::strerror(e));
    }
    default: {
      unsigned long first = ERR_peek_error();
      int reason = ERR_GET_LIB(first) == ERR_LIB_SSL ? ERR_GET_REASON(first) : 0;
      std::string detail = openssl_error_text();
      // A peer killed without close_notify: the same as a TCP EOF.
      if (reason == SSL_R_UNEXPECTED_EOF_WHILE_READING) return IoResult::eof();
      if (is_alert_reason(reason)) {
        int alert = reason - SSL_AD_REASON_OFFSET;
        if (certificate_alert(alert)) return IoResult::refused(refused_our_certificate(alert));
        return IoResult::failed(str_cat("peer sent ", alert_text(alert)));
      }
      return IoResult::failed(str_cat("TLS error: ", detail));
    }
  }
}

TcpLink::IoResult TlsLink::read_some(uint8_t* p, size_t n) {
  std::lock_guard<std::mutex> lock(ssl_mu_);
  ERR_clear_error();
  bio_->last_errno = 0;
  size_t got = 0;
  int rc = SSL_read_ex(ssl_, p, std::min(n, kMaxIo), &got);
  if (rc == 1) return IoResult::moved(got);
  return io_failure(SSL_get_error(ssl_, rc));
}

TcpLink::IoResult TlsLink::write_some(const iovec* iov, int iovcnt) {
  const uint8_t* buf = static_cast<const uint8_t*>(iov[0].iov_base);
  size_t len = iov[0].iov_len;
  if (len < kRecordPayload && iovcnt > 1) {
    // Coalesce a frame header with the start of its payload into one record (and one
    // TCP segment). After a WANT_* the framing code retries with unchanged iovecs, so
    // this rebuilds identical bytes, as SSL_write's retry rule requires.
    staging_.clear();
    for (int i = 0; i < iovcnt && staging_.size() < kRecordPayload; ++i) {
      const auto* b = static_cast<const uint8_t*>(iov[i].iov_base);
      size_t take = std::min(iov[i].iov_len, kRecordPayload - staging_.size());
      staging_.insert(staging_.end(), b, b + take);
    }
    buf = staging_.data();
    len = staging_.size();
  }
  len = std::min(len, kMaxIo);
  std::lock_guard<std::mutex> lock(ssl_mu_);
  ERR_clear_error();
  bio_->last_errno = 0;
  size_t written = 0;
  int rc = SSL_write_ex(ssl_, buf, len, &written);
  if (rc == 1) return IoResult::moved(written);
  IoResult io = io_failure(SSL_get_error(ssl_, rc));
  // SSL_write only wants to be retried once it holds an encrypted record of `buf` that
  // the socket did not take: the retry must be this same write (see IoResult::committed).
  io.committed = io.kind == IoResult::Kind::kWait;
  return io;
}

}  // namespace nebula::transport
