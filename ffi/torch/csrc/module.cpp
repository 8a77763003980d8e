// The Python module roccl._C: the backend class, registered under torch's c10d Backend type.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "backend.hpp"

namespace py = pybind11;

namespace roccl_torch {
void bindCommunicator(py::module_& m); // communicator.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The c10d types (Backend, Store) must be registered with pybind11 first.
  py::module_::import("torch.distributed");
  py::class_<
      roccl_torch::ProcessGroupRoccl,
      c10d::Backend,
      c10::intrusive_ptr<roccl_torch::ProcessGroupRoccl>>(m, "ProcessGroupRoccl")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Store>& store,
                      int rank,
                      int size,
                      std::chrono::milliseconds timeout,
                      bool deterministic) {
            return c10::make_intrusive<roccl_torch::ProcessGroupRoccl>(
                store, rank, size, timeout, deterministic);
          }),
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"),
          py::arg("deterministic") = false,
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "net_name",
          &roccl_torch::ProcessGroupRoccl::netName,
          "The network roccl uses between the ranks (shm, tcp, tcp+shm, ...).");
  roccl_torch::bindCommunicator(m);
  m.def(
      "_all_reduce_direct",
      [](at::Tensor tensor, const c10::intrusive_ptr<c10d::ProcessGroup>& group, int64_t op) {
        if (!group) {
          roccl_torch::raise(
              "roccl.all_reduce: no process group (None): call "
              "torch.distributed.init_process_group first, or pass a group");
        }
        return roccl_torch::allReduceDirect(tensor, *group, op);
      },
      py::arg("tensor"),
      py::arg("group"),
      py::arg("op"),
      py::call_guard<py::gil_scoped_release>(),
      "All-reduce `tensor` in place over `group` now, without a work object, when the "
      "group's backend for the tensor's device is roccl (True); False, and nothing done, "
      "when it is not (roccl.all_reduce's eager path).");
  m.def(
      "_launcher_env",
      [] {
        try {
          auto l = ::roccl_torch::launcher_env();
          py::dict d;
          d["launcher"] = std::string(l.launcher);
          d["rank"] = l.rank;
          d["nranks"] = l.nranks;
          d["host"] = std::string(l.host);
          d["port"] = l.port;
          return d;
        } catch (const rust::Error& e) {
          throw std::runtime_error(e.what());
        }
      },
      "Rank, size and rank 0's host and port, from the launcher's environment (srun, mpirun, "
      "torchrun or ROCCL_*), by roccl's rules.");
}
