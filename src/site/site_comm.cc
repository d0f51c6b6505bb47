#include "site/site_comm.h"

#include <algorithm>
#include <filesystem>

#include "nebula/error.h"
#include "nebula/units.h"
#include "site/gateway.h"
#include "transport/tcp_link.h"

namespace nebula::site {

namespace {

void create_run_dir(const Config& c) {
  std::error_code ec;  // the audit log's default place (RUN_DIR/audit.jsonl)
  std::filesystem::create_directories(c.job.run_dir, ec);
  if (ec)
    throw DataError(str_cat(c.job.run_dir, ": cannot create the run directory (job.run_dir in ", c.source_path,
                            "): ", ec.message()));
}

// wan.mode = "every_worker" (config.cc refuses it with [distill] and elastic sites): each
// worker's own links to every worker of the other sites; rank 0's links to the other rank 0s
// also form the gateway mesh, for the small collectives that go through the gateways.
void connect_every_worker(const Config& c, const WorkerIdentity& who, SiteComm& out) {
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(c.job.timeout);
  out.comm_group = out.group->fork("comm");
  create_run_dir(c);
  GatewayLinks links = connect_worker(c, who.site, who.local_rank);
  out.connector = std::move(links.connector);
  std::vector<collective::WorkerSlot> slots = worker_slots(c);
  const size_t self = static_cast<size_t>(
      std::find_if(slots.begin(), slots.end(),
                   [&](const collective::WorkerSlot& w) { return w.site == who.site && w.rank == who.local_rank; }) -
      slots.begin());
  std::vector<std::shared_ptr<transport::Link>> shared(std::make_move_iterator(links.links.begin()),
                                                       std::make_move_iterator(links.links.end()));
  out.workers = std::make_unique<collective::WorkerMesh>(self, std::move(slots), shared, timeout);
  if (who.local_rank == 0) {
    std::vector<std::shared_ptr<transport::Link>> gateways(c.sites.size());
    for (size_t s = 0; s < c.sites.size(); ++s)
      if (s != who.site) gateways[s] = out.workers->link(out.workers->slot(s, 0));
    collective::MeshOptions mo{out.training_index, out.training_names, timeout, false};
    out.mesh = std::make_unique<collective::GatewayMesh>(std::move(mo), std::move(gateways));
  }
  out.comm = std::make_unique<collective::Hierarchy>(*out.group, out.mesh.get(), out.workers.get(), out.comm_group.get());
}

}  // namespace

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
  if (c.wan.every_worker()) {
    connect_every_worker(c, who, out);
    return out;
  }
  if (who.local_rank == 0) {
    create_run_dir(c);
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

}  // namespace nebula::site
