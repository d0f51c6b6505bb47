#include "transport/certs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <set>
#include <openssl/evp.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::transport {
namespace {

namespace fs = std::filesystem;

// A temp dir named after this test file, removed afterwards.
struct ScopedDir : nebula::testing::TempDir {
  ScopedDir() : TempDir("certs_test") {}
};

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

mode_t file_mode(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

void expect_error_containing(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected nebula::Error containing \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(CertsTest, CreateCaTwiceRefusesTheSecond) {
  ScopedDir dir;
  const std::string ca_dir = dir.path() + "/pki";  // created by create_ca
  create_ca(ca_dir);
  EXPECT_TRUE(fs::exists(ca_key_path(ca_dir)));
  EXPECT_TRUE(fs::exists(ca_cert_path(ca_dir)));
  EXPECT_EQ(file_mode(ca_key_path(ca_dir)), 0600u);
  const std::string before = certificate_fingerprint(ca_cert_path(ca_dir));
  expect_error_containing([&] { create_ca(ca_dir); }, ca_key_path(ca_dir));
  // Nothing was replaced.
  EXPECT_EQ(certificate_fingerprint(ca_cert_path(ca_dir)), before);
  // Only the certificate left behind: still refused, naming that file.
  fs::remove(ca_key_path(ca_dir));
  expect_error_containing([&] { create_ca(ca_dir); }, ca_cert_path(ca_dir));
  EXPECT_FALSE(fs::exists(ca_key_path(ca_dir)));
}

// A host's own certificate of a site (every_worker, security.host_certs): it names the site,
// chains to the CA, has its own key, and leaves the site's certificate alone.
TEST(CertsTest, HostCertificatesNameTheirSiteWithTheirOwnKeys) {
  ScopedDir dir;
  create_ca(dir.path());
  issue_site_certificate(dir.path(), "site-b", "job-1");
  issue_host_certificate(dir.path(), "site-b", 0, "job-1");
  issue_host_certificate(dir.path(), "site-b", 1, "job-1");
  const std::string h0 = host_cert_path(dir.path(), "site-b", 0), h1 = host_cert_path(dir.path(), "site-b", 1);
  EXPECT_EQ(h1, dir.path() + "/hosts/site-b/1.pem");
  EXPECT_EQ(file_mode(host_key_path(dir.path(), "site-b", 1)), 0600u);
  EXPECT_EQ(certificate_identity(h0).site, "site-b");
  EXPECT_EQ(certificate_identity(h1).site, "site-b");
  EXPECT_EQ(certificate_identity(h1).job, "job-1");
  std::unique_ptr<X509, X509Free> ca(read_certificate(ca_cert_path(dir.path())));
  std::unique_ptr<X509, X509Free> cert(read_certificate(h1));
  std::unique_ptr<EVP_PKEY, PkeyFree> key(read_private_key(host_key_path(dir.path(), "site-b", 1)));
  EXPECT_EQ(X509_verify(cert.get(), X509_get0_pubkey(ca.get())), 1);
  EXPECT_EQ(X509_check_private_key(cert.get(), key.get()), 1);
  const std::set<std::string> fingerprints = {certificate_fingerprint(site_cert_path(dir.path(), "site-b")),
                                              certificate_fingerprint(h0), certificate_fingerprint(h1)};
  EXPECT_EQ(fingerprints.size(), 3u);
}

TEST(CertsTest, IssuedCertificateVerifiesAgainstItsCa) {
  ScopedDir dir;
  create_ca(dir.path());
  issue_site_certificate(dir.path(), "site-b", "job-1");
  const std::string pem = site_cert_path(dir.path(), "site-b");
  EXPECT_EQ(file_mode(site_key_path(dir.path(), "site-b")), 0600u);

  std::unique_ptr<X509, X509Free> ca(read_certificate(ca_cert_path(dir.path())));
  std::unique_ptr<X509, X509Free> cert(read_certificate(pem));
  std::unique_ptr<EVP_PKEY, PkeyFree> key(read_private_key(site_key_path(dir.path(), "site-b")));
  EXPECT_EQ(X509_verify(cert.get(), X509_get0_pubkey(ca.get())), 1);
  EXPECT_EQ(X509_check_private_key(cert.get(), key.get()), 1);
  EXPECT_EQ(X509_check_issued(ca.get(), cert.get()), X509_V_OK);

  const CertIdentity id = x509_identity(cert.get());
  EXPECT_TRUE(id.ok()) << id.problem;
  EXPECT_EQ(id.site, "site-b");
  EXPECT_EQ(id.job, "job-1");
  EXPECT_EQ(identity_uri("job-1", "site-b"), "urn:nebula:job:job-1:site:site-b");
  EXPECT_EQ(x509_dns_names(cert.get()), std::vector<std::string>{"site-b"});
  // The CA's own certificate names no job or site: it is no site's identity.
  EXPECT_NE(x509_identity(ca.get()).problem.find("names no nebula job and site"), std::string::npos);
  const std::string fp = certificate_fingerprint(pem);
  EXPECT_EQ(fp.size(), 64u);
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef"), std::string::npos) << fp;
  EXPECT_EQ(fp, x509_fingerprint(cert.get()));
  // Independent check of "SHA-256 of the DER".
  unsigned char* der = nullptr;
  int der_len = i2d_X509(cert.get(), &der);
  ASSERT_GT(der_len, 0);
  unsigned char md[32];
  unsigned int md_len = 0;
  ASSERT_EQ(EVP_Digest(der, static_cast<size_t>(der_len), md, &md_len, EVP_sha256(), nullptr), 1);
  OPENSSL_free(der);
  char hex[65];
  for (int i = 0; i < 32; ++i) std::snprintf(hex + 2 * i, 3, "%02x", md[i]);
  EXPECT_EQ(fp, std::string(hex));

  // Extensions as specified: an end-entity certificate for TLS client and server.
  EXPECT_EQ(X509_check_ca(cert.get()), 0);
  EXPECT_EQ(X509_check_ca(ca.get()), 1);
  EXPECT_TRUE(X509_get_key_usage(cert.get()) & KU_DIGITAL_SIGNATURE);
  EXPECT_TRUE(X509_get_extended_key_usage(cert.get()) & XKU_SSL_SERVER);
  EXPECT_TRUE(X509_get_extended_key_usage(cert.get()) & XKU_SSL_CLIENT);
  EXPECT_EQ(EVP_PKEY_get_base_id(key.get()), EVP_PKEY_EC);

  // A second certificate gets another key and serial.
  issue_site_certificate(dir.path(), "site-c", "job-1");
  std::unique_ptr<X509, X509Free> other(read_certificate(site_cert_path(dir.path(), "site-c")));
  EXPECT_NE(ASN1_INTEGER_cmp(X509_get0_serialNumber(cert.get()), X509_get0_serialNumber(other.get())), 0);
  EXPECT_NE(certificate_fingerprint(site_cert_path(dir.path(), "site-c")), fp);

  // A certificate of another CA does not verify against this one.
  ScopedDir other_dir;
  create_ca(other_dir.path());
  issue_site_certificate(other_dir.path(), "site-b", "job-1");
  std::unique_ptr<X509, X509Free> foreign(read_certificate(site_cert_path(other_dir.path(), "site-b")));
  EXPECT_NE(X509_verify(foreign.get(), X509_get0_pubkey(ca.get())), 1);
}

TEST(CertsTest, NonDnsSiteNameGetsCnOnly) {
  ScopedDir dir;
  create_ca(dir.path());
  issue_site_certificate(dir.path(), "site_a", "job-1");
  std::unique_ptr<X509, X509Free> cert(read_certificate(site_cert_path(dir.path(), "site_a")));
  EXPECT_EQ(x509_common_name(cert.get()), "site_a");
  EXPECT_TRUE(x509_dns_names(cert.get()).empty());
}

TEST(CertsTest, ValidityWindowFollowsTheArguments) {
  ScopedDir dir;
  create_ca(dir.path());
  issue_site_certificate(dir.path(), "old", "job-1", 1, -10 * 86400L);
  issue_site_certificate(dir.path(), "future", "job-1", 30, 86400L);
  std::unique_ptr<X509, X509Free> old_cert(read_certificate(site_cert_path(dir.path(), "old")));
  std::unique_ptr<X509, X509Free> future_cert(read_certificate(site_cert_path(dir.path(), "future")));
  EXPECT_LT(X509_cmp_current_time(X509_get0_notAfter(old_cert.get())), 0);     // in the past
  EXPECT_GT(X509_cmp_current_time(X509_get0_notBefore(future_cert.get())), 0); // in the future
}

TEST(CertsTest, InvalidSiteNamesAreRejected) {
  ScopedDir dir;
  create_ca(dir.path());
  for (std::string bad : {std::string(), std::string(65, 'a'), std::string("a b"), std::string("a/b"),
                          std::string("../x"), std::string("ca"), std::string("CA"), std::string("é"),
                          std::string("x\ny")}) {
    EXPECT_FALSE(is_valid_site_name(bad)) << bad;
    expect_error_containing([&] { issue_site_certificate(dir.path(), bad, "job-1"); }, "invalid site name \"" + bad + "\"");
  }
  for (const std::string& good : std::vector<std::string>{"a", "site-b", "site_a", "gw.site-b", "A.9_-", std::string(64, 'z')})
    EXPECT_TRUE(is_valid_site_name(good)) << good;
}

TEST(CertsTest, IssueWithoutCaNamesTheMissingFile) {
  ScopedDir dir;
  expect_error_containing([&] { issue_site_certificate(dir.path(), "alpha", "job-1"); }, ca_key_path(dir.path()));
  expect_error_containing([&] { issue_site_certificate(dir.path(), "alpha", "my job,DNS:x"); },
                          "invalid job name \"my job,DNS:x\"");
  expect_error_containing([&] { certificate_fingerprint(dir.path() + "/nope.pem"); }, dir.path() + "/nope.pem");
}

}  // namespace
}  // namespace nebula::transport
