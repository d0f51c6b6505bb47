#include "nebula/placement.h"

#include "nebula/error.h"

namespace nebula {
namespace {

int parse_count(const std::string& text, const std::string& from) {
  try {
    size_t used = 0;
    const long v = std::stol(text, &used);
    if (used == text.size() && v >= 0 && v < (1L << 30)) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  throw ConfigError(str_cat(from, " = \"", text, "\" is not a non-negative integer"));
}

}  // namespace

Placement resolve_placement(const Config& c, const std::string& site_option, const std::string& rank_option,
                            const Environment& env) {
  Placement p;
  std::string site_name = site_option;
  if (site_name.empty()) {
    const char* v = env("NEBULA_SITE");
    if (!v || !*v) {
      std::string names;
      for (const auto& s : c.sites) names += (names.empty() ? "" : ", ") + s.name;
      throw ConfigError(str_cat("nebula worker: no --site and no $NEBULA_SITE: say which site this process belongs "
                                "to (", names, ")"));
    }
    site_name = v;
  }
  p.site = c.site_index(site_name);
  const SiteConfig& site = c.sites[p.site];
  p.store = site.store;

  // The rank, and the size of the launch it comes from (-1: the site's workers by definition).
  struct Source {
    const char* launcher;
    const char* rank;
    const char* size;
  };
  static const Source kLaunchers[] = {{"torchrun", "RANK", "WORLD_SIZE"},
                                      {"open mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                      {"slurm", "SLURM_PROCID", "SLURM_NTASKS"}};
  int size = -1;
  std::string rank_from, size_from;
  if (!rank_option.empty()) {
    p.rank = parse_count(rank_option, "--rank");
    p.launcher = "command line";
    rank_from = "--rank";
  } else if (const char* v = env("NEBULA_RANK")) {
    p.rank = parse_count(v, "$NEBULA_RANK");
    p.launcher = "nebula";
    rank_from = "$NEBULA_RANK";
  } else {
    for (const Source& s : kLaunchers) {
      const char* r = env(s.rank);
      if (!r) continue;
      rank_from = str_cat("$", s.rank);
      p.rank = parse_count(r, rank_from);
      const char* n = env(s.size);
      if (!n)
        throw ConfigError(str_cat(rank_from, " = ", r, " is set but $", s.size, " is not: the ", s.launcher,
                                  " launch is incomplete (set both, or pass --rank)"));
      size_from = str_cat("$", s.size);
      size = parse_count(n, size_from);
      p.launcher = s.launcher;
      break;
    }
    if (p.launcher.empty()) {
      if (const char* v = env("LOCAL_RANK")) {  // torch.distributed.launch without RANK
        rank_from = "$LOCAL_RANK";
        p.rank = parse_count(v, rank_from);
        p.launcher = "torchrun";
      } else {
        throw ConfigError("nebula worker: no --rank and none of $NEBULA_RANK, $RANK (torchrun), "
                          "$OMPI_COMM_WORLD_RANK (Open MPI) or $SLURM_PROCID (Slurm): say which rank this is");
      }
    }
  }
  if (size < 0) {  // --rank / $NEBULA_RANK / $LOCAL_RANK: a $WORLD_SIZE that is set must still agree
    if (const char* n = env("WORLD_SIZE")) {
      size_from = "$WORLD_SIZE";
      size = parse_count(n, size_from);
    }
  }
  if (size >= 0 && size != site.workers)
    throw ConfigError(str_cat(size_from, " = ", size, " but site '", site.name, "' has workers = ", site.workers, " in ",
                              c.source_path, ": start one ", p.launcher, " launch of ", site.workers,
                              " processes per site, or make workers agree"));
  if (p.rank >= site.workers)
    throw ConfigError(str_cat(rank_from, " = ", p.rank, " but site '", site.name, "' has workers = ", site.workers,
                              " (ranks 0..", site.workers - 1, ") in ", c.source_path));

  // torchrun's rendezvous store is the site's.
  const char* addr = env("MASTER_ADDR");
  const char* port = env("MASTER_PORT");
  if (p.launcher == "torchrun" && (addr || port)) {
    if (!addr || !port)
      throw ConfigError(str_cat("$", addr ? "MASTER_PORT" : "MASTER_ADDR", " is missing while $",
                                addr ? "MASTER_ADDR" : "MASTER_PORT", " is set: torchrun sets both"));
    const int port_number = parse_count(port, "$MASTER_PORT");
    if (port_number < 1 || port_number > 65535)
      throw ConfigError(str_cat("$MASTER_PORT = ", port, " is not a TCP port"));
    const std::string host = addr;
    p.store = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + port;
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    p.external_store = agent && std::string(agent) == "True";
  }
  return p;
}

}  // namespace nebula
