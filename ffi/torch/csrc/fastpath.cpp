// torch.ops.roccl.all_reduce_: a blocking all-reduce in place that model code calls directly,
// as vLLM calls its own all-reduce ops: no Python wrapper of torch.distributed, no c10d
// dispatch to the backend, no work object, no hooks (the flight recorder's included).
// An operator of torch's library, so torch.compile traces it (its fake implementation, a
// no-op, is registered in roccl/__init__.py). A group whose backend is not roccl is served
// through the group's own allreduce.
#include "backend.hpp"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

namespace roccl_torch {
namespace {

void allReduceInPlace(at::Tensor& tensor, c10::string_view group, int64_t op) {
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
  opts.reduceOp =
      c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
  const auto pg = c10d::resolve_process_group(std::string(group));
  const auto backend = pg->getBackend(tensor.device().type());
  if (auto* roccl = dynamic_cast<ProcessGroupRoccl*>(backend.get())) {
    roccl->allReduceNow(tensor, opts);
    return;
  }
  std::vector<at::Tensor> tensors{tensor};
  pg->allreduce(tensors, opts)->wait();
}

} // namespace
} // namespace roccl_torch

TORCH_LIBRARY(roccl, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str group_name, int op=0) -> ()");
}

TORCH_LIBRARY_IMPL(roccl, CPU, m) {
  m.impl("all_reduce_", &roccl_torch::allReduceInPlace);
}
