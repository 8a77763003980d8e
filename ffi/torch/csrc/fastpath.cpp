// The all-reduce that model code calls directly, as vLLM calls its own all-reduce ops: no
// Python wrapper of torch.distributed, no c10d dispatch to the backend, no work object, no
// hooks (the flight recorder's included). Two entries:
// - roccl._C._all_reduce_direct(tensor, group, op): eager Python's (roccl.all_reduce and
//   roccl.direct_all_reduce()), with the group object in hand; false when the group's
//   backend for the tensor is not roccl (nothing done: the caller takes torch's path);
// - torch.ops.roccl.all_reduce_(tensor, group_name, op): an operator of torch's library,
//   for torch.compile (its fake implementation, a no-op, is registered in
//   roccl/__init__.py); a group of another backend is served through the group's allreduce.
#include "backend.hpp"

#include <Python.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

namespace roccl_torch {
namespace {

c10d::AllreduceOptions optionsOf(int64_t op) {
  if (op == static_cast<int64_t>(c10d::ReduceOp::PREMUL_SUM)) {
    raise(
        "roccl.all_reduce: PREMUL_SUM carries a factor this call cannot take: use "
        "torch.distributed.all_reduce with the ReduceOp from _make_nccl_premul_sum");
  }
  if (op < 0 || op >= static_cast<int64_t>(c10d::ReduceOp::UNUSED)) {
    raise(
        "roccl.all_reduce: the reduction " + std::to_string(op) +
        " is not one of torch.distributed.ReduceOp's (SUM 0, AVG 1, PRODUCT 2, MIN 3, MAX 4)");
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
  return opts;
}

// The group's roccl backend for `t`'s device, or null.
ProcessGroupRoccl* rocclOf(c10d::ProcessGroup& pg, const at::Tensor& t) {
  if (!pg.hasBackends() || !pg.hasBackendForDeviceType(t.device().type())) {
    return nullptr;
  }
  return dynamic_cast<ProcessGroupRoccl*>(pg.getBackend(t.device().type()).get());
}

// The operator's kernel may be called with the GIL held (eager Python, torch.compile's
// Python wrapper) or not (C++ callers): a call that may block lets other threads run.
class WithoutGil {
 public:
  WithoutGil()
      : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

void allReduceOperator(at::Tensor& tensor, c10::string_view group, int64_t op) {
  const auto opts = optionsOf(op);
  const auto pg = c10d::resolve_process_group(std::string(group));
  WithoutGil unlocked;
  if (auto* roccl = rocclOf(*pg, tensor)) {
    roccl->allReduceNow(tensor, opts);
    return;
  }
  std::vector<at::Tensor> tensors{tensor};
  pg->allreduce(tensors, opts)->wait();
}

} // namespace

bool allReduceDirect(at::Tensor& tensor, c10d::ProcessGroup& pg, int64_t op) {
  auto* roccl = rocclOf(pg, tensor);
  if (roccl == nullptr) {
    return false;
  }
  roccl->allReduceNow(tensor, optionsOf(op));
  return true;
}

} // namespace roccl_torch

TORCH_LIBRARY(roccl, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str group_name, int op=0) -> ()");
}

TORCH_LIBRARY_IMPL(roccl, CPU, m) {
  m.impl("all_reduce_", &roccl_torch::allReduceOperator);
}
