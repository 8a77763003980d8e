// The c10d operations of ProcessGroupRoccl: each checks its tensors, maps the data type and
// reduction, and builds a work whose steps pass the tensors' memory straight to roccl
// (contiguous tensors are used in place; others go through a contiguous copy and are
// copied back when the work completes).
#include "backend.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace roccl_torch {

Dtype dtypeOf(const at::Tensor& t, const std::string& op) {
  switch (t.scalar_type()) {
    case at::kChar:
      return Dtype::I8;
    case at::kByte:
    case at::kBool:
      return Dtype::U8;
    case at::kInt:
      return Dtype::I32;
    case at::kUInt32:
      return Dtype::U32;
    case at::kLong:
      return Dtype::I64;
    case at::kUInt64:
      return Dtype::U64;
    case at::kHalf:
      return Dtype::F16;
    case at::kFloat:
      return Dtype::F32;
    case at::kDouble:
      return Dtype::F64;
    case at::kBFloat16:
      return Dtype::Bf16;
    case at::kFloat8_e4m3fn:
      return Dtype::F8E4M3;
    case at::kFloat8_e5m2:
      return Dtype::F8E5M2;
    default:
      raise(
          "roccl does not support the data type " + std::string(c10::toString(t.scalar_type())) + " (" +
          op +
          "): roccl takes float32/64, float16, bfloat16, int8, uint8, int32, int64, "
          "bool, float8_e4m3fn and float8_e5m2");
  }
}

namespace {

std::string str(at::ScalarType t) {
  return c10::toString(t);
}

size_t bytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

size_t addrOf(const at::Tensor& t) {
  return reinterpret_cast<size_t>(t.data_ptr());
}

// A CPU, strided tensor (others are refused with what to do instead).
void checkTensor(const at::Tensor& t, const std::string& op) {
  if (!t.defined()) {
    raise("roccl: " + op + ": got an undefined tensor");
  }
  if (t.layout() != at::kStrided) {
    raise(
        "roccl does not support " + c10::str(t.layout()) + " tensors (" + op +
        "): pass a dense (strided) tensor");
  }
  if (!t.device().is_cpu()) {
    raise(
        "roccl does not support tensors on " + t.device().str() + " (" + op +
        "): this build runs collectives on CPU tensors; move the tensor to the CPU, or use a "
        "device:backend pair such as init_process_group(\"cpu:roccl,cuda:nccl\")");
  }
}

// A reduction for roccl, and the factor of PREMUL_SUM (applied to the input first).
struct Red {
  Reduction op = Reduction::Sum;
  bool premul = false;
  double factor = 1.0;
  at::Tensor tensorFactor;
};

Red reductionOf(
    const c10d::ReduceOp& r,
    const at::Tensor& t,
    const std::string& op) {
  Red red;
  const bool isBool = t.scalar_type() == at::kBool;
  switch (r.op_) {
    case c10d::ReduceOp::SUM:
      red.op = isBool ? Reduction::Max : Reduction::Sum; // logical or
      break;
    case c10d::ReduceOp::PRODUCT:
      red.op = isBool ? Reduction::Min : Reduction::Prod; // logical and
      break;
    case c10d::ReduceOp::MIN:
      red.op = Reduction::Min;
      break;
    case c10d::ReduceOp::MAX:
      red.op = Reduction::Max;
      break;
    case c10d::ReduceOp::AVG:
      if (isBool) {
        raise("roccl does not support AVG on bool tensors (" + op + ")");
      }
      red.op = Reduction::Avg;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      if (!at::isFloatingType(t.scalar_type()) ||
          t.scalar_type() == at::kFloat8_e4m3fn ||
          t.scalar_type() == at::kFloat8_e5m2) {
        raise(
            "roccl does not support PREMUL_SUM on " + str(t.scalar_type()) + " (" +
            op + "): it takes float32/64, float16 and bfloat16");
      }
      auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(r.supplement_.get());
      if (s == nullptr) {
        raise("roccl: " + op + ": PREMUL_SUM without its factor");
      }
      red.op = Reduction::Sum;
      red.premul = true;
      red.factor = s->double_factor;
      red.tensorFactor = s->tensor_factor;
      break;
    }
    default:
      raise(
          "roccl does not support the reduction " +
          std::to_string(static_cast<int>(r.op_)) + " (" + op +
          "; bitwise BAND/BOR/BXOR): it takes SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM");
  }
  return red;
}

// `t` scaled by the PREMUL_SUM factor, as a new tensor.
at::Tensor scaled(const at::Tensor& t, const Red& red) {
  if (red.tensorFactor.defined()) {
    return t.mul(red.tensorFactor.to(t.device()).to(t.scalar_type()));
  }
  return t.mul(red.factor);
}

// The contiguous tensor roccl works on for `t`, and the copy back when it is not `t`.
at::Tensor workingCopy(WorkRoccl& w, at::Tensor t) {
  if (t.is_contiguous()) {
    return t;
  }
  at::Tensor c = t.contiguous();
  w.finish.push_back([t, c]() mutable { t.copy_(c); });
  return c;
}

void checkOne(const std::vector<at::Tensor>& ts, const std::string& op) {
  if (ts.size() != 1) {
    raise(
        "roccl: " + op + " takes one tensor per process, got " +
        std::to_string(ts.size()));
  }
  checkTensor(ts[0], op);
}

void checkSame(
    const at::Tensor& a,
    const at::Tensor& b,
    const std::string& op) {
  checkTensor(b, op);
  if (a.scalar_type() != b.scalar_type()) {
    raise(
        "roccl: " + op + ": the tensors' data types differ (" +
        str(a.scalar_type()) + " and " + str(b.scalar_type()) + ")");
  }
}

void checkRank(int64_t r, int size, const std::string& what) {
  if (r < 0 || r >= size) {
    raise(
        "roccl: " + what + " " + std::to_string(r) + " is out of range for " +
        std::to_string(size) + " ranks");
  }
}

// When `ts` are contiguous, of equal size and back to back in memory: their first tensor's
// storage as one flat tensor over all of them; otherwise undefined.
at::Tensor adjacent(const std::vector<at::Tensor>& ts) {
  if (ts.empty()) {
    return at::Tensor();
  }
  const size_t bytes = bytesOf(ts[0]);
  const size_t base = addrOf(ts[0]);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].is_contiguous() || bytesOf(ts[i]) != bytes ||
        ts[i].scalar_type() != ts[0].scalar_type() ||
        addrOf(ts[i]) != base + i * bytes) {
      return at::Tensor();
    }
  }
  if (bytes == 0) {
    return at::Tensor();
  }
  const int64_t n = ts[0].numel() * static_cast<int64_t>(ts.size());
  return ts[0].as_strided({n}, {1}, ts[0].storage_offset());
}

// One tensor made of `ts` (copied), each flattened, in order.
at::Tensor concatenated(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  flat.reserve(ts.size());
  for (auto& t : ts) {
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
}

void addCollective(
    WorkRoccl& w,
    Kind kind,
    Dtype dt,
    Reduction op,
    size_t root,
    at::Tensor send,
    bool inPlace,
    at::Tensor recv) {
  w.steps.push_back([=](const Comm& c, uint64_t timeoutMs) {
    c.collective(
        kind,
        dt,
        op,
        root,
        inPlace ? 0 : addrOf(send),
        inPlace ? 0 : bytesOf(send),
        inPlace,
        addrOf(recv),
        bytesOf(recv),
        timeoutMs);
  });
}

} // namespace

// ---------------------------------------------------------------------------------------
// Reductions

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  checkOne(tensors, "allreduce");
  auto& t = tensors[0];
  const Red red = reductionOf(opts.reduceOp, t, "allreduce");
  auto w = work(c10d::OpType::ALLREDUCE, "roccl:all_reduce");
  at::Tensor buf = workingCopy(*w, t);
  if (red.premul) {
    at::Tensor s = scaled(buf, red);
    buf.copy_(s);
  }
  addCollective(
      *w, Kind::AllReduce, dtypeOf(t, "allreduce"), red.op, 0, buf, true, buf);
  w->outputs.push_back(t);
  return submit(w, opts.asyncOp, opts.timeout);
}

void ProcessGroupRoccl::allReduceNow(
    at::Tensor& t,
    const c10d::AllreduceOptions& opts) {
  checkTensor(t, "all_reduce_");
  const Red red = reductionOf(opts.reduceOp, t, "all_reduce_");
  if (!red.premul && !coalesced_ && t.is_contiguous()) {
    const Dtype dt = dtypeOf(t, "all_reduce_");
    const bool ran = queue_->runNow([&](const Comm& c) {
      sequence_.fetch_add(1);
      c.collective(
          Kind::AllReduce, dt, red.op, 0, 0, 0, true, addrOf(t), bytesOf(t), 0);
    });
    if (ran) {
      return;
    }
  }
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions blocking = opts;
  blocking.asyncOp = false;
  allreduce(tensors, blocking)->wait();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  auto w = work(c10d::OpType::ALLREDUCE_COALESCED, "roccl:all_reduce_coalesced");
  for (auto& t : tensors) {
    checkTensor(t, "allreduce_coalesced");
    const Red red = reductionOf(opts.reduceOp, t, "allreduce_coalesced");
    at::Tensor buf = workingCopy(*w, t);
    if (red.premul) {
      buf.copy_(scaled(buf, red));
    }
    addCollective(
        *w,
        Kind::AllReduce,
        dtypeOf(t, "allreduce_coalesced"),
        red.op,
        0,
        buf,
        true,
        buf);
    w->outputs.push_back(t);
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  checkOne(tensors, "reduce");
  checkRank(opts.rootRank, getSize(), "reduce: the root rank");
  auto& t = tensors[0];
  const Red red = reductionOf(opts.reduceOp, t, "reduce");
  auto w = work(c10d::OpType::REDUCE, "roccl:reduce");
  at::Tensor buf = workingCopy(*w, t);
  if (red.premul) {
    buf.copy_(scaled(buf, red));
  }
  addCollective(
      *w,
      Kind::Reduce,
      dtypeOf(t, "reduce"),
      red.op,
      static_cast<size_t>(opts.rootRank),
      buf,
      true,
      buf);
  w->outputs.push_back(t);
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  checkOne(tensors, "broadcast");
  checkRank(opts.rootRank, getSize(), "broadcast: the root rank");
  if (opts.rootTensor != 0) {
    raise("roccl: broadcast: rootTensor must be 0 (one tensor per process)");
  }
  auto& t = tensors[0];
  auto w = work(c10d::OpType::BROADCAST, "roccl:broadcast");
  at::Tensor buf = workingCopy(*w, t);
  addCollective(
      *w,
      Kind::Broadcast,
      dtypeOf(t, "broadcast"),
      Reduction::Sum,
      static_cast<size_t>(opts.rootRank),
      buf,
      true,
      buf);
  w->outputs.push_back(t);
  return submit(w, opts.asyncOp, opts.timeout);
}

// ---------------------------------------------------------------------------------------
// All-gather

namespace {

// All-gather of `input` into `output` (`size` times its elements), zero-copy when both are
// contiguous; in place when the input is the output's block `rank`.
void addAllgatherBase(
    WorkRoccl& w,
    at::Tensor output,
    at::Tensor input,
    int rank,
    int size,
    const std::string& op) {
  checkTensor(output, op);
  checkSame(output, input, op);
  if (output.numel() != input.numel() * size) {
    raise(
        "roccl: " + op + ": the output has " + std::to_string(output.numel()) +
        " elements; it must have " + std::to_string(size) + " x the input's " +
        std::to_string(input.numel()));
  }
  const Dtype dt = dtypeOf(input, op);
  at::Tensor out = workingCopy(w, output);
  at::Tensor in = input.is_contiguous() ? input : input.contiguous();
  const bool inPlace = out.numel() > 0 &&
      addrOf(in) == addrOf(out) + static_cast<size_t>(rank) * bytesOf(in);
  addCollective(w, Kind::AllGather, dt, Reduction::Sum, 0, in, inPlace, out);
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  auto w = work(c10d::OpType::_ALLGATHER_BASE, "roccl:all_gather_into_tensor");
  addAllgatherBase(*w, output, input, getRank(), getSize(), "all_gather_into_tensor");
  w->outputs.push_back(output);
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (outputs.size() != inputs.size()) {
    raise("roccl: allgather_into_tensor_coalesced: as many outputs as inputs are needed");
  }
  auto w = work(c10d::OpType::COALESCED, "roccl:all_gather_into_tensor_coalesced");
  for (size_t i = 0; i < inputs.size(); ++i) {
    addAllgatherBase(
        *w, outputs[i], inputs[i], getRank(), getSize(), "allgather_into_tensor_coalesced");
    w->outputs.push_back(outputs[i]);
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

namespace {

// All-gather of `input` into the list `outs` (one tensor per rank).
void addAllgatherList(
    WorkRoccl& w,
    std::vector<at::Tensor> outs,
    at::Tensor input,
    int rank,
    int size,
    const std::string& op) {
  checkTensor(input, op);
  if (outs.size() != static_cast<size_t>(size)) {
    raise(
        "roccl: " + op + ": the output list has " + std::to_string(outs.size()) +
        " tensors; it must have one per rank (" + std::to_string(size) + ")");
  }
  for (auto& o : outs) {
    checkSame(input, o, op);
    if (o.numel() != input.numel()) {
      raise("roccl: " + op + ": every output tensor must have the input's number of elements");
    }
  }
  at::Tensor flat = adjacent(outs);
  if (flat.defined()) {
    addAllgatherBase(w, flat, input, rank, size, op);
    return;
  }
  flat = at::empty({input.numel() * size}, input.options());
  addAllgatherBase(w, flat, input, rank, size, op);
  w.finish.push_back([outs, flat, n = input.numel()]() mutable {
    for (size_t i = 0; i < outs.size(); ++i) {
      outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n).view(outs[i].sizes()));
    }
  });
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  checkOne(inputs, "allgather");
  if (outputs.size() != 1) {
    raise("roccl: allgather takes one output list per process");
  }
  auto w = work(c10d::OpType::ALLGATHER, "roccl:all_gather");
  addAllgatherList(*w, outputs[0], inputs[0], getRank(), getSize(), "allgather");
  for (auto& o : outputs[0]) {
    w->outputs.push_back(o);
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // As torch's `all_gather_coalesced` (and Gloo) lay them out: one output list per rank,
  // each with one tensor per input (outputLists[rank][input]).
  const size_t ranks = static_cast<size_t>(getSize());
  if (inputs.empty()) {
    raise("roccl: allgather_coalesced: no input tensors");
  }
  if (outputLists.size() != ranks) {
    raise(
        "roccl: allgather_coalesced: " + std::to_string(outputLists.size()) +
        " output lists; one per rank is needed (" + std::to_string(ranks) + ")");
  }
  for (size_t p = 0; p < ranks; ++p) {
    if (outputLists[p].size() != inputs.size()) {
      raise(
          "roccl: allgather_coalesced: output list " + std::to_string(p) + " has " +
          std::to_string(outputLists[p].size()) + " tensors; one per input is needed (" +
          std::to_string(inputs.size()) + ")");
    }
  }
  auto w = work(c10d::OpType::ALLGATHER_COALESCED, "roccl:all_gather_coalesced");
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> outs;
    outs.reserve(ranks);
    for (size_t p = 0; p < ranks; ++p) {
      outs.push_back(outputLists[p][i]);
    }
    addAllgatherList(*w, outs, inputs[i], getRank(), getSize(), "allgather_coalesced");
  }
  for (auto& list : outputLists) {
    for (auto& o : list) {
      w->outputs.push_back(o);
    }
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

// ---------------------------------------------------------------------------------------
// Reduce-scatter

namespace {

void addReduceScatterBase(
    WorkRoccl& w,
    at::Tensor output,
    at::Tensor input,
    const c10d::ReduceOp& rop,
    int rank,
    int size,
    const std::string& op) {
  checkTensor(input, op);
  checkSame(input, output, op);
  if (input.numel() != output.numel() * size) {
    raise(
        "roccl: " + op + ": the input has " + std::to_string(input.numel()) +
        " elements; it must have " + std::to_string(size) + " x the output's " +
        std::to_string(output.numel()));
  }
  const Red red = reductionOf(rop, input, op);
  const Dtype dt = dtypeOf(input, op);
  at::Tensor in = input.is_contiguous() ? input : input.contiguous();
  if (red.premul) {
    in = scaled(in, red);
  }
  at::Tensor out = workingCopy(w, output);
  if (out.numel() > 0 &&
      addrOf(out) == addrOf(in) + static_cast<size_t>(rank) * bytesOf(out)) {
    // The output is the input's own block: in place over the whole input.
    addCollective(w, Kind::ReduceScatter, dt, red.op, 0, in, true, in);
  } else {
    addCollective(w, Kind::ReduceScatter, dt, red.op, 0, in, false, out);
  }
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  auto w = work(c10d::OpType::_REDUCE_SCATTER_BASE, "roccl:reduce_scatter_tensor");
  addReduceScatterBase(
      *w, output, input, opts.reduceOp, getRank(), getSize(), "reduce_scatter_tensor");
  w->outputs.push_back(output);
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() != inputs.size()) {
    raise("roccl: reduce_scatter_tensor_coalesced: as many outputs as inputs are needed");
  }
  auto w = work(c10d::OpType::COALESCED, "roccl:reduce_scatter_tensor_coalesced");
  for (size_t i = 0; i < inputs.size(); ++i) {
    addReduceScatterBase(
        *w,
        outputs[i],
        inputs[i],
        opts.reduceOp,
        getRank(),
        getSize(),
        "reduce_scatter_tensor_coalesced");
    w->outputs.push_back(outputs[i]);
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  checkOne(outputs, "reduce_scatter");
  if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(getSize())) {
    raise(
        "roccl: reduce_scatter takes one input list per process with one tensor per rank (" +
        std::to_string(getSize()) + ")");
  }
  for (auto& t : inputs[0]) {
    checkSame(outputs[0], t, "reduce_scatter");
    if (t.numel() != outputs[0].numel()) {
      raise("roccl: reduce_scatter: every input tensor must have the output's number of elements");
    }
  }
  auto w = work(c10d::OpType::REDUCE_SCATTER, "roccl:reduce_scatter");
  at::Tensor flat = adjacent(inputs[0]);
  if (!flat.defined()) {
    flat = outputs[0].numel() > 0 ? concatenated(inputs[0])
                                  : at::empty({0}, outputs[0].options());
  }
  addReduceScatterBase(
      *w, outputs[0], flat, opts.reduceOp, getRank(), getSize(), "reduce_scatter");
  w->outputs.push_back(outputs[0]);
  return submit(w, opts.asyncOp, opts.timeout);
}

// ---------------------------------------------------------------------------------------
// All-to-all, gather, scatter (point-to-point batches where sizes differ)

namespace {

std::vector<int64_t> splitsOf(
    const std::vector<int64_t>& given,
    const at::Tensor& t,
    int size,
    const std::string& which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (given.empty()) {
    if (rows % size != 0) {
      raise(
          "roccl: all_to_all_single: the " + which + "'s first dimension (" +
          std::to_string(rows) + ") does not divide by " + std::to_string(size) +
          " ranks: pass split sizes");
    }
    return std::vector<int64_t>(size, rows / size);
  }
  if (given.size() != static_cast<size_t>(size)) {
    raise(
        "roccl: all_to_all_single: " + std::to_string(given.size()) + " " + which +
        " split sizes for " + std::to_string(size) + " ranks");
  }
  int64_t sum = 0;
  for (auto s : given) {
    if (s < 0) {
      raise("roccl: all_to_all_single: a negative " + which + " split size");
    }
    sum += s;
  }
  if (sum != rows) {
    raise(
        "roccl: all_to_all_single: the " + which + " split sizes add up to " +
        std::to_string(sum) + ", but its first dimension is " + std::to_string(rows));
  }
  return given;
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits,
    const c10d::AllToAllOptions& opts) {
  const std::string op = "all_to_all_single";
  checkTensor(output, op);
  checkSame(output, input, op);
  const int n = getSize();
  auto ins = splitsOf(inputSplits, input, n, "input");
  auto outs = splitsOf(outputSplits, output, n, "output");
  const Dtype dt = dtypeOf(input, op);
  auto w = work(c10d::OpType::ALLTOALL_BASE, "roccl:all_to_all_single");
  at::Tensor out = workingCopy(*w, output);
  at::Tensor in = input.is_contiguous() ? input : input.contiguous();
  if (in.numel() > 0 && addrOf(in) < addrOf(out) + bytesOf(out) &&
      addrOf(out) < addrOf(in) + bytesOf(in)) {
    in = in.clone(); // the same memory in and out: keep the input apart
  }
  const bool even = std::all_of(ins.begin(), ins.end(), [&](int64_t s) { return s == ins[0]; }) &&
      ins == outs && in.numel() == out.numel();
  if (even) {
    addCollective(*w, Kind::AllToAll, dt, Reduction::Sum, 0, in, false, out);
  } else {
    const int64_t inRow = input.dim() == 0 || input.size(0) == 0 ? 0 : input.numel() / input.size(0);
    const int64_t outRow =
        output.dim() == 0 || output.size(0) == 0 ? 0 : output.numel() / output.size(0);
    at::Tensor in1 = in.reshape({-1});
    at::Tensor out1 = out.view({-1});
    int64_t inOff = 0, outOff = 0;
    for (int p = 0; p < n; ++p) {
      if (ins[p] * inRow > 0) {
        w->p2p.push_back({true, static_cast<size_t>(p), in1.narrow(0, inOff, ins[p] * inRow)});
      }
      if (outs[p] * outRow > 0) {
        w->p2p.push_back(
            {false, static_cast<size_t>(p), out1.narrow(0, outOff, outs[p] * outRow)});
      }
      inOff += ins[p] * inRow;
      outOff += outs[p] * outRow;
    }
  }
  w->outputs.push_back(output);
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  const int n = getSize();
  if (outputs.size() != static_cast<size_t>(n) || inputs.size() != static_cast<size_t>(n)) {
    raise("roccl: all_to_all takes one input and one output tensor per rank");
  }
  auto w = work(c10d::OpType::ALLTOALL, "roccl:all_to_all");
  for (int p = 0; p < n; ++p) {
    checkTensor(inputs[p], "all_to_all");
    checkSame(inputs[p], outputs[p], "all_to_all");
    dtypeOf(inputs[p], "all_to_all");
    at::Tensor in = inputs[p].contiguous();
    if (addrOf(in) == addrOf(outputs[p]) && in.numel() > 0) {
      in = in.clone();
    }
    at::Tensor out = workingCopy(*w, outputs[p]);
    if (in.numel() > 0) {
      w->p2p.push_back({true, static_cast<size_t>(p), in});
    }
    if (out.numel() > 0) {
      w->p2p.push_back({false, static_cast<size_t>(p), out});
    }
    w->outputs.push_back(outputs[p]);
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  checkOne(inputs, "gather");
  checkRank(opts.rootRank, getSize(), "gather: the root rank");
  dtypeOf(inputs[0], "gather");
  const size_t root = static_cast<size_t>(opts.rootRank);
  auto w = work(c10d::OpType::GATHER, "roccl:gather");
  at::Tensor in = inputs[0].contiguous();
  if (static_cast<size_t>(getRank()) == root) {
    if (outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(getSize())) {
      raise("roccl: gather: the root needs one output list with one tensor per rank");
    }
    for (int p = 0; p < getSize(); ++p) {
      at::Tensor o = outputs[0][p];
      checkSame(in, o, "gather");
      if (o.numel() != in.numel()) {
        raise("roccl: gather: every output tensor must have the input's number of elements");
      }
      if (static_cast<size_t>(p) == root) {
        w->finish.push_back([o, in]() mutable { o.copy_(in.view(o.sizes())); });
      } else if (in.numel() > 0) {
        w->p2p.push_back({false, static_cast<size_t>(p), workingCopy(*w, o)});
      }
      w->outputs.push_back(o);
    }
  } else {
    if (!outputs.empty() && !outputs[0].empty()) {
      raise("roccl: gather: only the root passes output tensors");
    }
    if (in.numel() > 0) {
      w->p2p.push_back({true, root, in});
    }
  }
  return submit(w, opts.asyncOp, opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  checkOne(outputs, "scatter");
  checkRank(opts.rootRank, getSize(), "scatter: the root rank");
  dtypeOf(outputs[0], "scatter");
  const size_t root = static_cast<size_t>(opts.rootRank);
  auto w = work(c10d::OpType::SCATTER, "roccl:scatter");
  at::Tensor out = workingCopy(*w, outputs[0]);
  if (static_cast<size_t>(getRank()) == root) {
    if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(getSize())) {
      raise("roccl: scatter: the root needs one input list with one tensor per rank");
    }
    for (int p = 0; p < getSize(); ++p) {
      at::Tensor i = inputs[0][p].contiguous();
      checkSame(out, i, "scatter");
      if (i.numel() != out.numel()) {
        raise("roccl: scatter: every input tensor must have the output's number of elements");
      }
      if (static_cast<size_t>(p) == root) {
        // The root's own block: copied in a step (steps run before the copies back).
        w->steps.push_back([out, i](const Comm&, uint64_t) mutable { out.copy_(i.view(out.sizes())); });
      } else if (i.numel() > 0) {
        w->p2p.push_back({true, static_cast<size_t>(p), i});
      }
    }
  } else {
    if (!inputs.empty() && !inputs[0].empty()) {
      raise("roccl: scatter: only the root passes input tensors");
    }
    if (out.numel() > 0) {
      w->p2p.push_back({false, root, out});
    }
  }
  w->outputs.push_back(outputs[0]);
  return submit(w, opts.asyncOp, opts.timeout);
}

// ---------------------------------------------------------------------------------------
// Point-to-point and barrier

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int /* tag: messages between two ranks match in order */) {
  checkOne(tensors, "send");
  checkRank(dstRank, getSize(), "send: the destination rank");
  dtypeOf(tensors[0], "send");
  auto w = work(c10d::OpType::SEND, "roccl:send");
  w->p2p.push_back({true, static_cast<size_t>(dstRank), tensors[0].contiguous()});
  w->mergeable = w.get() != coalesced_.get();
  return submit(w, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int /* tag */) {
  checkOne(tensors, "recv");
  checkRank(srcRank, getSize(), "recv: the source rank");
  dtypeOf(tensors[0], "recv");
  auto w = work(c10d::OpType::RECV, "roccl:recv");
  w->p2p.push_back({false, static_cast<size_t>(srcRank), workingCopy(*w, tensors[0])});
  w->outputs.push_back(tensors[0]);
  w->mergeable = w.get() != coalesced_.get();
  return submit(w, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::recvAnysource(
    std::vector<at::Tensor>& /* tensors */,
    int /* tag */) {
  raise(
      "roccl does not support recv from any source (src=None): name the source rank");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::barrier(
    const c10d::BarrierOptions& opts) {
  auto w = work(c10d::OpType::BARRIER, "roccl:barrier");
  w->steps.push_back([](const Comm& c, uint64_t timeoutMs) {
    c.collective(Kind::Barrier, Dtype::U8, Reduction::Sum, 0, 0, 0, true, 0, 0, timeoutMs);
  });
  return submit(w, opts.asyncOp, opts.timeout);
}

} // namespace roccl_torch
