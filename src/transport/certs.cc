#include "transport/certs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "nebula/error.h"

namespace nebula::transport {
namespace {

namespace fs = std::filesystem;

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using ExtPtr = std::unique_ptr<X509_EXTENSION, Deleter<X509_EXTENSION, X509_EXTENSION_free>>;
using BnPtr = std::unique_ptr<BIGNUM, Deleter<BIGNUM, BN_free>>;
using NamesPtr = std::unique_ptr<GENERAL_NAMES, Deleter<GENERAL_NAMES, GENERAL_NAMES_free>>;
struct BioFree {
  void operator()(BIO* b) const { BIO_free_all(b); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;

constexpr int kMaxSiteName = 64;

bool is_dns_name(const std::string& s) {
  if (s.empty() || s.size() > 253) return false;
  size_t start = 0;
  for (;;) {
    size_t dot = s.find('.', start);
    std::string label = s.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') return false;
    for (char c : label)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
    if (dot == std::string::npos) return true;
    start = dot + 1;
  }
}

std::string bio_text(BIO* bio) {
  char* data = nullptr;
  long n = BIO_get_mem_data(bio, &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string();
}

// Writes `data` to a fresh temporary file next to `path` with `mode`, fsyncs it, then
// moves it into place: link(2) when `exclusive` (fails if `path` exists, atomically),
// else rename(2) (replaces).
void write_file(const std::string& path, const std::string& data, mode_t mode, bool exclusive) {
  std::string tmp = str_cat(path, ".tmp-", ::getpid());
  ::unlink(tmp.c_str());  // a leftover of a crashed earlier run with our pid
  int fd = ::open(tmp.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, mode);
  if (fd < 0) throw Error(str_cat("cannot create ", tmp, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t r = ::write(fd, data.data() + done, data.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(str_cat("cannot write ", tmp, ": ", std::strerror(err)));
    }
    done += static_cast<size_t>(r);
  }
  // The umask may have narrowed `mode`; a key must be exactly 0600 either way.
  (void)::fchmod(fd, mode);
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw Error(str_cat("cannot write ", tmp, ": ", std::strerror(err)));
  }
  int rc = exclusive ? ::link(tmp.c_str(), path.c_str()) : ::rename(tmp.c_str(), path.c_str());
  int err = errno;
  ::unlink(tmp.c_str());  // after link(); a no-op after a successful rename()
  if (rc != 0) {
    if (err == EEXIST)
      throw Error(str_cat(path, " already exists; refusing to overwrite it"));
    throw Error(str_cat("cannot create ", path, ": ", std::strerror(err)));
  }
}

std::string pem_of_key(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1)
    throw Error(str_cat("cannot encode private key: ", openssl_error_text()));
  return bio_text(bio.get());
}

std::string pem_of_cert(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1)
    throw Error(str_cat("cannot encode certificate: ", openssl_error_text()));
  return bio_text(bio.get());
}

PkeyPtr new_p256_key() {
  PkeyPtr key(EVP_EC_gen("P-256"));
  if (!key) throw Error(str_cat("cannot generate an EC P-256 key: ", openssl_error_text()));
  return key;
}

// A positive, non-zero 128-bit random serial.
void set_random_serial(X509* cert) {
  unsigned char bytes[16];
  do {
    if (RAND_bytes(bytes, sizeof bytes) != 1) throw Error(str_cat("RAND_bytes failed: ", openssl_error_text()));
    bytes[0] &= 0x7f;
  } while (std::all_of(bytes, bytes + sizeof bytes, [](unsigned char b) { return b == 0; }));
  BnPtr bn(BN_bin2bn(bytes, sizeof bytes, nullptr));
  if (!bn || !BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert)))
    throw Error(str_cat("cannot set the serial number: ", openssl_error_text()));
}

void add_ext(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  ExtPtr ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()));
  if (!ext || X509_add_ext(cert, ext.get(), -1) != 1)
    throw Error(str_cat("cannot add the ", OBJ_nid2sn(nid), " extension \"", value, "\": ", openssl_error_text()));
}

// A v3 certificate skeleton: serial, validity, subject CN, public key.
X509Ptr new_cert(EVP_PKEY* key, const std::string& cn, long valid_from_offset_s, int days) {
  X509Ptr cert(X509_new());
  if (!cert) throw Error(str_cat("X509_new failed: ", openssl_error_text()));
  X509_set_version(cert.get(), X509_VERSION_3);
  set_random_serial(cert.get());
  if (!X509_gmtime_adj(X509_getm_notBefore(cert.get()), valid_from_offset_s) ||
      !X509_gmtime_adj(X509_getm_notAfter(cert.get()), valid_from_offset_s + 86400L * days))
    throw Error(str_cat("cannot set the validity period: ", openssl_error_text()));
  X509_NAME* name = X509_get_subject_name(cert.get());
  if (X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(cn.c_str()), -1,
                                 -1, 0) != 1)
    throw Error(str_cat("cannot set the subject CN \"", cn, "\": ", openssl_error_text()));
  if (X509_set_pubkey(cert.get(), key) != 1) throw Error(str_cat("X509_set_pubkey failed: ", openssl_error_text()));
  return cert;
}

void sign(X509* cert, EVP_PKEY* key) {
  if (X509_sign(cert, key, EVP_sha256()) <= 0)
    throw Error(str_cat("cannot sign the certificate: ", openssl_error_text()));
}

void check_days(int days) {
  if (days < 1) throw Error(str_cat("certificate validity must be at least 1 day, got ", days));
}

std::string asn1_time_text(const ASN1_TIME* t) {
  if (!t) return "?";
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || ASN1_TIME_print(bio.get(), t) != 1) return "?";
  return bio_text(bio.get());
}

}  // namespace

std::string openssl_error_text() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    // "error:0480006C:PEM routines::no start line" -> keep the readable tail.
    const char* reason = ERR_reason_error_string(e);
    const char* lib = ERR_lib_error_string(e);
    out += reason ? str_cat(lib ? lib : "OpenSSL", ": ", reason) : std::string(buf);
  }
  return out.empty() ? "no detail" : out;
}

bool is_valid_site_name(const std::string& site) {
  if (site.empty() || site.size() > kMaxSiteName) return false;
  for (char c : site)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') return false;
  if (site.size() == 2 && std::tolower(static_cast<unsigned char>(site[0])) == 'c' &&
      std::tolower(static_cast<unsigned char>(site[1])) == 'a')
    return false;
  return true;
}

void check_site_name(const std::string& site) {
  if (!is_valid_site_name(site))
    throw Error(str_cat("invalid site name \"", site, "\": a site name is 1 to ", kMaxSiteName,
                        " characters from A-Z a-z 0-9 . _ - and not \"ca\" (reserved for the CA's files)"));
}

void check_job_name(const std::string& job) {
  if (job.empty() || job.size() > kMaxSiteName ||
      !std::all_of(job.begin(), job.end(),
                   [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'; }))
    throw Error(str_cat("invalid job name \"", job, "\" for a certificate: a job name is 1 to ", kMaxSiteName,
                        " characters from A-Z a-z 0-9 . _ - ([job] name)"));
}

std::string identity_uri(const std::string& job, const std::string& site) {
  return str_cat("urn:nebula:job:", job, ":site:", site);
}

std::string ca_key_path(const std::string& dir) { return (fs::path(dir) / "ca.key").string(); }
std::string ca_cert_path(const std::string& dir) { return (fs::path(dir) / "ca.pem").string(); }
std::string site_key_path(const std::string& dir, const std::string& site) {
  return (fs::path(dir) / (site + ".key")).string();
}
std::string site_cert_path(const std::string& dir, const std::string& site) {
  return (fs::path(dir) / (site + ".pem")).string();
}
std::string host_key_path(const std::string& dir, const std::string& site, int rank) {
  return (fs::path(dir) / "hosts" / site / (std::to_string(rank) + ".key")).string();
}
std::string host_cert_path(const std::string& dir, const std::string& site, int rank) {
  return (fs::path(dir) / "hosts" / site / (std::to_string(rank) + ".pem")).string();
}

X509* read_certificate(const std::string& pem_path) {
  ERR_clear_error();
  BioPtr bio(BIO_new_file(pem_path.c_str(), "r"));
  if (!bio) throw Error(str_cat("cannot open certificate ", pem_path, ": ", std::strerror(errno)));
  X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
  if (!cert) throw Error(str_cat("cannot read certificate ", pem_path, ": ", openssl_error_text()));
  return cert;
}

EVP_PKEY* read_private_key(const std::string& pem_path) {
  ERR_clear_error();
  BioPtr bio(BIO_new_file(pem_path.c_str(), "r"));
  if (!bio) throw Error(str_cat("cannot open private key ", pem_path, ": ", std::strerror(errno)));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr);
  if (!key) throw Error(str_cat("cannot read private key ", pem_path, ": ", openssl_error_text()));
  return key;
}

void create_ca(const std::string& dir, int days) {
  check_days(days);
  const std::string key_path = ca_key_path(dir), cert_path = ca_cert_path(dir);
  for (const auto& p : {key_path, cert_path}) {
    if (fs::exists(p))
      throw Error(str_cat("create CA: ", p, " already exists; refusing to overwrite an existing CA (every "
                          "certificate it issued would stop working). Use that CA, or remove its files first"));
  }
  std::error_code ec;
  if (fs::create_directories(dir, ec)) fs::permissions(dir, fs::perms::owner_all, ec);
  if (!fs::is_directory(dir)) throw Error(str_cat("create CA: cannot create directory ", dir, ": ", ec.message()));

  PkeyPtr key = new_p256_key();
  unsigned char tag[4];
  RAND_bytes(tag, sizeof tag);
  char hex[9];
  std::snprintf(hex, sizeof hex, "%02x%02x%02x%02x", tag[0], tag[1], tag[2], tag[3]);
  // A distinct CN per CA, so that two CAs are told apart in messages and by chain building.
  X509Ptr cert = new_cert(key.get(), str_cat("nebula site CA ", hex), 0, days);
  X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get()));
  add_ext(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0");
  add_ext(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign");
  add_ext(cert.get(), cert.get(), NID_subject_key_identifier, "hash");
  add_ext(cert.get(), cert.get(), NID_authority_key_identifier, "keyid:always");
  sign(cert.get(), key.get());

  try {
    write_file(key_path, pem_of_key(key.get()), 0600, /*exclusive=*/true);
  } catch (const Error& e) {
    throw Error(str_cat("create CA: ", e.what()));
  }
  try {
    write_file(cert_path, pem_of_cert(cert.get()), 0644, /*exclusive=*/true);
  } catch (const Error& e) {
    ::unlink(key_path.c_str());  // ours, written just above: do not leave a key without its certificate
    throw Error(str_cat("create CA: ", e.what()));
  }
}

namespace {

// A certificate naming `site`, signed by DIR's CA, written to key_file and cert_file.
void issue_certificate(const std::string& dir, const std::string& site, const std::string& job,
                       const std::string& key_file, const std::string& cert_file, int days, long valid_from_offset_s) {
  check_site_name(site);
  check_job_name(job);
  check_days(days);
  const std::string ca_key_file = ca_key_path(dir), ca_cert_file = ca_cert_path(dir);
  for (const auto& p : {ca_key_file, ca_cert_file}) {
    if (!fs::exists(p))
      throw Error(str_cat("issue certificate for site \"", site, "\": ", p,
                          " does not exist; create the CA first with `nebula certs init ", dir, "`"));
  }
  PkeyPtr ca_key(read_private_key(ca_key_file));
  X509Ptr ca_cert(read_certificate(ca_cert_file));
  if (X509_check_private_key(ca_cert.get(), ca_key.get()) != 1)
    throw Error(str_cat("issue certificate for site \"", site, "\": CA key ", ca_key_file,
                        " does not match CA certificate ", ca_cert_file, " (", openssl_error_text(), ")"));

  PkeyPtr key = new_p256_key();
  X509Ptr cert = new_cert(key.get(), site, valid_from_offset_s, days);
  X509_set_issuer_name(cert.get(), X509_get_subject_name(ca_cert.get()));
  add_ext(cert.get(), ca_cert.get(), NID_basic_constraints, "critical,CA:FALSE");
  add_ext(cert.get(), ca_cert.get(), NID_key_usage, "critical,digitalSignature");
  add_ext(cert.get(), ca_cert.get(), NID_ext_key_usage, "serverAuth,clientAuth");
  add_ext(cert.get(), ca_cert.get(), NID_subject_key_identifier, "hash");
  add_ext(cert.get(), ca_cert.get(), NID_authority_key_identifier, "keyid:always");
  // The identity URI (names checked above: no ',' or ':' to confuse the config syntax), and a
  // DNS name for tools that want one.
  add_ext(cert.get(), ca_cert.get(), NID_subject_alt_name,
          str_cat("URI:", identity_uri(job, site), is_dns_name(site) ? ",DNS:" + site : std::string()));
  sign(cert.get(), ca_key.get());

  fs::create_directories(fs::path(cert_file).parent_path());
  // Key first: a new certificate next to the old key would not load.
  write_file(key_file, pem_of_key(key.get()), 0600, /*exclusive=*/false);
  write_file(cert_file, pem_of_cert(cert.get()), 0644, /*exclusive=*/false);
}

}  // namespace

void issue_site_certificate(const std::string& dir, const std::string& site, const std::string& job, int days,
                            long valid_from_offset_s) {
  issue_certificate(dir, site, job, site_key_path(dir, site), site_cert_path(dir, site), days, valid_from_offset_s);
}

void issue_host_certificate(const std::string& dir, const std::string& site, int rank, const std::string& job,
                            int days) {
  NEBULA_CHECK(rank >= 0, "host certificate of site ", site, ": rank ", rank);
  issue_certificate(dir, site, job, host_key_path(dir, site, rank), host_cert_path(dir, site, rank), days, 0);
}

std::string x509_fingerprint(const X509* cert) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!cert || X509_digest(cert, EVP_sha256(), md, &len) != 1)
    throw Error(str_cat("cannot compute a certificate fingerprint: ", openssl_error_text()));
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(2 * len);
  for (unsigned i = 0; i < len; ++i) {
    out += kHex[md[i] >> 4];
    out += kHex[md[i] & 15];
  }
  return out;
}

std::string x509_common_name(const X509* cert) {
  if (!cert) return {};
  const X509_NAME* name = X509_get_subject_name(cert);
  int idx = X509_NAME_get_index_by_NID(name, NID_commonName, -1);
  if (idx < 0) return {};
  const ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(name, idx));
  unsigned char* utf8 = nullptr;
  int n = ASN1_STRING_to_UTF8(&utf8, data);
  if (n < 0) return {};
  std::string out(reinterpret_cast<char*>(utf8), static_cast<size_t>(n));
  OPENSSL_free(utf8);
  return out;
}

std::vector<std::string> x509_dns_names(const X509* cert) {
  std::vector<std::string> out;
  if (!cert) return out;
  NamesPtr names(static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  if (!names) return out;
  for (int i = 0; i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* gn = sk_GENERAL_NAME_value(names.get(), i);
    if (gn->type != GEN_DNS) continue;
    const ASN1_IA5STRING* s = gn->d.dNSName;
    out.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(s)), static_cast<size_t>(ASN1_STRING_length(s)));
  }
  return out;
}

std::string x509_not_before(const X509* cert) { return cert ? asn1_time_text(X509_get0_notBefore(cert)) : "?"; }
std::string x509_not_after(const X509* cert) { return cert ? asn1_time_text(X509_get0_notAfter(cert)) : "?"; }

std::string certificate_fingerprint(const std::string& pem_path) {
  X509Ptr cert(read_certificate(pem_path));
  return x509_fingerprint(cert.get());
}

CertIdentity x509_identity(const X509* cert) {
  CertIdentity id;
  if (!cert) {
    id.problem = "no certificate";
    return id;
  }
  constexpr std::string_view kPrefix = "urn:nebula:job:";
  std::vector<std::string> found;
  NamesPtr names(static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  for (int i = 0; names && i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* gn = sk_GENERAL_NAME_value(names.get(), i);
    if (gn->type != GEN_URI) continue;
    std::string uri(reinterpret_cast<const char*>(ASN1_STRING_get0_data(gn->d.uniformResourceIdentifier)),
                    static_cast<size_t>(ASN1_STRING_length(gn->d.uniformResourceIdentifier)));
    if (uri.starts_with(kPrefix)) found.push_back(std::move(uri));
  }
  if (found.size() != 1) {
    id.problem = found.empty() ? "the certificate names no nebula job and site (no subjectAltName "
                                 "urn:nebula:job:<job>:site:<site>; it was not issued by `nebula certs issue` of this "
                                 "version)"
                               : str_cat("the certificate names ", found.size(), " nebula identities; it must name one");
    return id;
  }
  const std::string& uri = found[0];
  const size_t at = uri.rfind(":site:");
  if (at == std::string::npos || at < kPrefix.size()) {
    id.problem = str_cat("malformed identity \"", uri, "\" (expected urn:nebula:job:<job>:site:<site>)");
    return id;
  }
  id.job = uri.substr(kPrefix.size(), at - kPrefix.size());
  id.site = uri.substr(at + 6);
  if (id.job.empty() || !is_valid_site_name(id.site))
    id.problem = str_cat("malformed identity \"", uri, "\" (expected urn:nebula:job:<job>:site:<site>)");
  return id;
}

CertIdentity certificate_identity(const std::string& pem_path) {
  X509Ptr cert(read_certificate(pem_path));
  return x509_identity(cert.get());
}

}  // namespace nebula::transport
