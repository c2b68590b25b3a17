// collectived_torch._C: the Python face of the backend. collectived_torch's
// __init__ registers _create_backend with torch.distributed.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include "client/collective.h"
#include "client/torch/backend.h"
#include "client/torch/cuda_launch.h"

namespace py = pybind11;
using collectived::client::torch_backend::Backend;

PYBIND11_MODULE(_C, m) {
  m.doc() = "collectived's torch.distributed backend (see collectived_torch)";
  // The base class must be known to pybind before ours derives from it.
  py::module_::import("torch.distributed");
  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "ProcessGroupCollectived")
      .def("where", &Backend::where);
  m.def(
      "_create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         std::chrono::milliseconds timeout, const std::string& group_name,
         const std::string& socket) {
        Backend::Config c;
        c.timeout = timeout;
        c.group_name = group_name;
        c.socket = socket;
        return c10::make_intrusive<Backend>(store, rank, size, std::move(c));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
      py::arg("group_name") = "", py::arg("socket") = "",
      py::call_guard<py::gil_scoped_release>());
  m.def("library_version", [] { return std::string(collective_version()); });
  m.def("cuda_built", &collectived::client::torch_backend::cuda_built);
}
