// nebula._nebula: the Python bindings of the library API (include/nebula/session.h) and the
// torch.distributed backend (process_group.h). The Python package (nebula/*.py) builds on
// these; nothing here is a second implementation: every collective and strategy is the C++
// one `nebula worker` runs.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "nebula/config.h"
#include "nebula/error.h"
#include "nebula/placement.h"
#include "nebula/session.h"
#include "python/process_group.h"
#include "train/metrics.h"

namespace py = pybind11;

namespace nebula::python {
namespace {

// Placement from the arguments, else from the environment: $NEBULA_SITE/$NEBULA_RANK (what
// `nebula run` sets), torchrun's, Open MPI's or Slurm's variables (nebula/placement.h).
std::shared_ptr<Session> make_session(const std::string& config_path, const std::string& site,
                                      std::optional<int> rank, const std::vector<std::string>& overrides) {
  const std::string path = !config_path.empty() ? config_path : [] {
    const char* v = std::getenv("NEBULA_CONFIG");
    if (!v || !*v)
      throw ConfigError("nebula.Session(): no config path given and $NEBULA_CONFIG is not set (`nebula run` sets it)");
    return std::string(v);
  }();
  Config config = load_config(path, overrides);
  Placement p = resolve_placement(config, site, rank ? std::to_string(*rank) : std::string(),
                                  [](const char* v) { return std::getenv(v); });
  return std::make_shared<Session>(config, p);
}

}  // namespace
}  // namespace nebula::python

PYBIND11_MODULE(_nebula, m) {
  using namespace nebula;
  using nebula::python::ProcessGroupNebula;
  m.doc() = "nebula's C++ library (include/nebula/session.h) for Python; use the `nebula` package";

  // nebula's exceptions as Python types: Error ⊃ ConfigError, DataError, NetworkError ⊃ PeerLost,
  // Timeout, AuthError. The message is nebula's (file:line, key, peer, what to do).
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<ConfigError> config_error(m, "ConfigError", error.ptr());
  static py::exception<DataError> data_error(m, "DataError", error.ptr());
  static py::exception<NetworkError> network_error(m, "NetworkError", error.ptr());
  static py::exception<PeerLost> peer_lost(m, "PeerLost", network_error.ptr());
  static py::exception<Timeout> timeout(m, "Timeout", network_error.ptr());
  static py::exception<AuthError> auth_error(m, "AuthError", network_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PeerLost& e) {
      peer_lost(e.what());
    } catch (const Timeout& e) {
      timeout(e.what());
    } catch (const AuthError& e) {
      auth_error(e.what());
    } catch (const NetworkError& e) {
      network_error(e.what());
    } catch (const ConfigError& e) {
      config_error(e.what());
    } catch (const DataError& e) {
      data_error(e.what());
    } catch (const Error& e) {
      error(e.what());
    }
  });

  m.def("set_cpu_threads", &set_cpu_threads, py::arg("threads"));
  m.def("check_config", [](const std::string& path, const std::vector<std::string>& overrides) {
    load_config(path, overrides);
  }, py::arg("path"), py::arg("overrides") = std::vector<std::string>{});

  py::class_<Session, std::shared_ptr<Session>>(m, "Session")
      .def(py::init(&python::make_session), py::arg("config") = "", py::arg("site") = "",
           py::arg("rank") = py::none(), py::arg("overrides") = std::vector<std::string>{},
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("site", &Session::site)
      .def_property_readonly("site_index", &Session::site_index)
      .def_property_readonly("local_rank", &Session::local_rank)
      .def_property_readonly("site_workers", &Session::site_workers)
      .def_property_readonly("rank", &Session::global_rank)
      .def_property_readonly("world_size", &Session::world_size)
      .def_property_readonly("run_dir", [](const Session& s) { return s.config().job.run_dir; })
      .def_property_readonly("config_path", [](const Session& s) { return s.config().source_path; })
      .def_property_readonly("steps", [](const Session& s) { return s.config().job.steps; })
      .def_property_readonly("log_every", [](const Session& s) { return s.config().job.log_every; })
      .def_property_readonly("seed", [](const Session& s) { return s.config().job.seed; })
      .def_property_readonly("sites", [](const Session& s) {
        std::vector<std::string> names;
        for (const auto& site : s.config().sites) names.push_back(site.name);
        return names;
      })
      .def_property_readonly("strategy", [](const Session& s) { return s.config().strategy.kind; })
      .def_property_readonly("wan_bytes_sent", &Session::wan_bytes_sent)
      .def_property_readonly("wan_bytes_received", &Session::wan_bytes_received)
      .def("all_reduce_mean", [](Session& s, at::Tensor t, double weight) { s.allreduce(t, weight); },
           py::arg("tensor"), py::arg("weight") = 1.0, py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_sum", [](Session& s, at::Tensor t) { s.allreduce_sum(t); }, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast", [](Session& s, at::Tensor t, int root) { s.broadcast(t, root); }, py::arg("tensor"),
           py::arg("root") = 0, py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Session::allgather, py::arg("tensor"), py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Session::barrier, py::call_guard<py::gil_scoped_release>())
      .def("site_barrier", &Session::site_barrier, py::call_guard<py::gil_scoped_release>());

  py::class_<Synchronizer>(m, "Synchronizer")
      .def(py::init<Session&, std::vector<at::Tensor>, std::vector<at::Tensor>>(), py::arg("session"),
           py::arg("params"), py::arg("buffers") = std::vector<at::Tensor>{}, py::keep_alive<1, 2>(),
           py::call_guard<py::gil_scoped_release>())
      .def("keep_training", py::overload_cast<int64_t, int64_t>(&Synchronizer::keep_training, py::const_),
           py::arg("step"), py::arg("steps"))
      .def("before_backward", &Synchronizer::before_backward, py::arg("weight") = 1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("sync_gradients", &Synchronizer::sync_gradients, py::arg("weight") = 1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("observe_loss", &Synchronizer::observe_loss, py::arg("loss"))
      .def_property_readonly("watches_quality", &Synchronizer::watches_quality)
      .def("after_step", &Synchronizer::after_step, py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def("finish", &Synchronizer::finish, py::call_guard<py::gil_scoped_release>())
      .def("drain", &Synchronizer::drain, py::call_guard<py::gil_scoped_release>())
      .def("can_save", &Synchronizer::can_save)
      .def_property_readonly("name", &Synchronizer::name)
      .def("metrics", &Synchronizer::metrics)
      .def("decisions", &Synchronizer::decisions)
      .def("state", [](const Synchronizer& s) {
        Synchronizer::State st = s.state();
        py::dict d;
        d["tensors"] = st.tensors;
        d["numbers"] = st.numbers;
        d["strings"] = st.strings;
        d["decisions"] = st.decisions;
        return d;
      })
      .def("load_state", [](Synchronizer& s, py::dict d) {
        Synchronizer::State st;
        st.tensors = d["tensors"].cast<std::map<std::string, at::Tensor>>();
        st.numbers = d["numbers"].cast<std::map<std::string, double>>();
        st.strings = d["strings"].cast<std::map<std::string, std::string>>();
        st.decisions = d["decisions"].cast<std::vector<std::string>>();
        py::gil_scoped_release release;
        s.load_state(st);
      });

  // The backend: torch.distributed must be imported first (it registers ProcessGroup's type).
  m.def("process_group", [](std::shared_ptr<Session> s) -> c10::intrusive_ptr<python::BackendBase> {
    return c10::make_intrusive<ProcessGroupNebula>(std::move(s));
  }, py::arg("session"));

  // RUN_DIR/metrics.jsonl and summary.json, written as `nebula worker` writes them (train/metrics.h).
  py::class_<train::MetricsWriter>(m, "MetricsWriter")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("write", [](train::MetricsWriter& w, const std::string& line) { w.write(nlohmann::json::parse(line)); },
           py::arg("json_line"));
  m.def("write_json_atomically", [](const std::string& path, const std::string& json) {
    train::write_json_atomically(path, nlohmann::json::parse(json));
  }, py::arg("path"), py::arg("json"));
  m.def("peak_rss_bytes", &train::peak_rss_bytes);
}
