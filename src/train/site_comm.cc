#include "train/site_comm.h"

#include <filesystem>

#include "nebula/error.h"
#include "nebula/units.h"
#include "train/gateway.h"
#include "transport/tcp_link.h"

namespace nebula::train {

SiteComm connect_site(const Config& c, const WorkerIdentity& who, bool rejoin) {
  const SiteConfig& site = c.sites.at(who.site);
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(c.job.timeout);
  SiteComm out;
  auto [store_host, store_port] = transport::parse_host_port(who.store.empty() ? site.store : who.store);
  out.group = std::make_unique<collective::SiteGroup>(site.name, store_host, store_port, who.local_rank,
                                                      static_cast<int>(site.workers), timeout,
                                                      std::function<void(uint16_t)>{}, who.external_store);
  for (const auto& s : c.sites)
    if (!c.distill.enabled() || s.name != c.distill.teacher_site) out.training_names.push_back(s.name);
  out.training_index = c.distill.enabled() ? 0 : who.site;
  if (who.local_rank == 0) {
    std::error_code ec;  // the audit log's default place (RUN_DIR/audit.jsonl)
    std::filesystem::create_directories(c.job.run_dir, ec);
    if (ec)
      throw DataError(str_cat(c.job.run_dir, ": cannot create the run directory (job.run_dir in ", c.source_path,
                              "): ", ec.message()));
    GatewayLinks gateway = connect_gateway(c, who.site, rejoin);
    out.connector = std::move(gateway.connector);
    if (c.distill.enabled()) {
      out.teacher = std::move(gateway.links[c.site_index(c.distill.teacher_site)]);
      gateway.links.clear();
      gateway.links.emplace_back();
    }
    collective::MeshOptions mo{out.training_index, out.training_names, timeout, c.job.elastic};
    if (c.job.elastic && !c.distill.enabled()) {  // mesh indices are config indices then
      transport::SiteConnector* connector = out.connector.get();
      mo.rejoin = [connector](size_t j, Deadline d) { return connector->rejoin(j, d); };
      mo.joining = rejoin;
    }
    out.mesh = std::make_unique<collective::GatewayMesh>(std::move(mo), std::move(gateway.links));
  }
  out.comm = std::make_unique<collective::Hierarchy>(*out.group, out.mesh.get());
  return out;
}

}  // namespace nebula::train
