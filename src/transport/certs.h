// A tiny site CA (DESIGN.md, "Security"): one CA per deployment issues one certificate
// per site; the site name is the certificate's subject CN (and a subjectAltName DNS
// entry when the name is a valid DNS name). Built on the OpenSSL 3 C API, no shelling out.
//
// Files in a certificate directory DIR:
//   DIR/ca.key      the CA's private key (mode 0600); keep it off the training hosts if you can
//   DIR/ca.pem      the CA certificate every site trusts
//   DIR/<site>.key  a site's private key (mode 0600)
//   DIR/<site>.pem  its certificate, signed by DIR/ca.key
// Keys are EC P-256, signatures ECDSA-SHA256, serials 128 random bits.
//
// Every function throws nebula::Error naming the file (or the site name) on failure. Files
// are written to a temporary name, fsynced, then linked/renamed into place, so a crash
// never leaves half a key.
//
// Thread safety: the functions share no state; do not run two on the same files at once.
#pragma once

#include <openssl/types.h>

#include <string>
#include <vector>

namespace nebula::transport {

// Site names: 1..64 characters from [A-Za-z0-9._-], and not "ca" (any case), which would
// collide with the CA's own files.
bool is_valid_site_name(const std::string& site);
// Throws nebula::Error naming `site` and the rule when !is_valid_site_name(site).
void check_site_name(const std::string& site);

std::string ca_key_path(const std::string& dir);                             // DIR/ca.key
std::string ca_cert_path(const std::string& dir);                            // DIR/ca.pem
std::string site_key_path(const std::string& dir, const std::string& site);  // DIR/<site>.key
std::string site_cert_path(const std::string& dir, const std::string& site); // DIR/<site>.pem
// One host's own certificate of a site (wan.mode = "every_worker", security.host_certs):
// DIR/hosts/<site>/<rank>.pem and .key; it names the site, as the site's certificate does.
std::string host_key_path(const std::string& dir, const std::string& site, int rank);
std::string host_cert_path(const std::string& dir, const std::string& site, int rank);

// Creates DIR (mode 0700) if needed and a new self-signed CA valid for `days` from now:
// DIR/ca.key (0600) and DIR/ca.pem. Refuses -- nebula::Error naming the existing file --
// when either file already exists: replacing a CA silently would invalidate every
// certificate it issued.
void create_ca(const std::string& dir, int days = 3650);

// Identity. A certificate names its job and its site in one subjectAltName URI,
//   urn:nebula:job:<job>:site:<site>
// and both ends of a link take the peer's identity from there and only there (x509_identity):
// so a site of job X cannot join job Y under the same site name with a certificate from a
// shared CA, and neither side can be fooled by a CN or a DNS name. The CN repeats the site
// name for people and tools.
struct CertIdentity {
  std::string job, site;
  std::string problem;  // why there is no identity; empty when there is one
  bool ok() const { return problem.empty(); }
};
std::string identity_uri(const std::string& job, const std::string& site);
CertIdentity x509_identity(const X509* cert);
CertIdentity certificate_identity(const std::string& pem_path);  // throws if it cannot be read
// A job name that can be put in a certificate: the site name rule (below). Throws nebula::Error
// naming the job and the rule.
void check_job_name(const std::string& job);

// Issues (or re-issues, replacing the old files) the certificate of `site` of `job`, signed
// by DIR/ca.key: DIR/<site>.key (0600) and DIR/<site>.pem. Subject CN = site;
// subjectAltName identity_uri(job, site), and DNS:<site> when the name is a valid DNS name
// (labels of [A-Za-z0-9-], not starting or ending with '-', separated by dots);
// basicConstraints CA:FALSE; keyUsage digitalSignature; extendedKeyUsage serverAuth and
// clientAuth (one certificate serves a gateway both as client and as server).
// Validity: from now + valid_from_offset_s for `days` days; tests use this to make
// expired (offset -10 days, 1 day) and not-yet-valid (offset +1 day) certificates.
void issue_site_certificate(const std::string& dir, const std::string& site, const std::string& job, int days = 825,
                            long valid_from_offset_s = 0);
// The same for worker `rank` of `site`: host_cert_path/host_key_path, the same identity (each
// host of a site gets its own key, so one leaked host key can be revoked alone).
void issue_host_certificate(const std::string& dir, const std::string& site, int rank, const std::string& job,
                            int days = 825);

// SHA-256 of the certificate's DER encoding, as 64 lowercase hex digits.
std::string certificate_fingerprint(const std::string& pem_path);

// The same on a certificate in memory (used by TlsLink on the peer's certificate).
std::string x509_fingerprint(const X509* cert);
std::string x509_common_name(const X509* cert);     // "" when there is none
std::vector<std::string> x509_dns_names(const X509* cert);  // subjectAltName DNS entries
// "2026-05-01 12:00:00 UTC" style text of the certificate's notBefore / notAfter.
std::string x509_not_before(const X509* cert);
std::string x509_not_after(const X509* cert);

// Reads a PEM certificate / private key; nebula::Error naming the file and the OpenSSL
// reason. The caller owns the result (X509_free / EVP_PKEY_free).
X509* read_certificate(const std::string& pem_path);
EVP_PKEY* read_private_key(const std::string& pem_path);

// Drains this thread's OpenSSL error queue into one line ("a; b"), or "no detail".
std::string openssl_error_text();

}  // namespace nebula::transport
