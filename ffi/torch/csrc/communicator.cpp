// roccl.Communicator: roccl's collectives for Python programs that are not torch.distributed
// programs, on anything with the buffer protocol (numpy arrays, bytearray, array.array,
// memoryview) or on CPU torch tensors. The buffers' addresses and sizes come from the objects
// themselves (never from the caller), checked C-contiguous, and the objects stay referenced
// while roccl works on them with the GIL released.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "backend.hpp"

namespace py = pybind11;

namespace roccl_torch {

namespace {

// One buffer of a call: its memory, size and data type, and what keeps it alive.
struct Buffer {
  size_t addr = 0;
  size_t bytes = 0;
  Dtype dtype = Dtype::U8;
  std::string dtypeName;
  std::unique_ptr<py::buffer_info> view;  // a buffer-protocol object's exported view
  at::Tensor tensor;                      // or a tensor
};

[[noreturn]] void refuse(const std::string& msg) {
  throw py::value_error("roccl: " + msg);
}

Dtype dtypeOfFormat(std::string f, size_t itemsize, const std::string& what) {
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@' || f[0] == '|')) {
    f = f.substr(1);
  }
  struct Entry {
    const char* format;
    size_t size;
    Dtype dtype;
  };
  static const Entry table[] = {
      {"f", 4, Dtype::F32}, {"d", 8, Dtype::F64}, {"e", 2, Dtype::F16},
      {"b", 1, Dtype::I8},  {"B", 1, Dtype::U8},  {"?", 1, Dtype::U8},
      {"c", 1, Dtype::U8},  {"i", 4, Dtype::I32}, {"I", 4, Dtype::U32},
      {"l", 8, Dtype::I64}, {"q", 8, Dtype::I64}, {"L", 8, Dtype::U64},
      {"Q", 8, Dtype::U64},
  };
  for (const auto& e : table) {
    if (f == e.format && itemsize == e.size) {
      return e.dtype;
    }
  }
  refuse(
      what + " has the element format '" + f + "' (" + std::to_string(itemsize) +
      " bytes), which roccl has no data type for: use float16/32/64, int8/32/64, "
      "uint8/32/64 or bool (bfloat16 and float8 as torch tensors)");
}

Buffer bufferOf(py::handle obj, bool write, const std::string& what) {
  Buffer b;
  if (THPVariable_Check(obj.ptr())) {
    at::Tensor t = THPVariable_Unpack(obj.ptr());
    if (!t.device().is_cpu() || t.layout() != at::kStrided) {
      refuse(what + " is a tensor on " + t.device().str() + ": roccl.Communicator takes dense CPU tensors");
    }
    if (!t.is_contiguous()) {
      refuse(what + " is not contiguous: pass tensor.contiguous() (and copy the result back)");
    }
    b.dtype = dtypeOf(t, "roccl.Communicator");
    b.dtypeName = c10::toString(t.scalar_type());
    b.addr = reinterpret_cast<size_t>(t.data_ptr());
    b.bytes = static_cast<size_t>(t.numel()) * t.element_size();
    b.tensor = t;
    return b;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    refuse(
        what + " (" + std::string(py::str(py::type::of(obj).attr("__name__"))) +
        ") is neither a buffer (numpy array, bytearray, memoryview, ...) nor a torch tensor");
  }
  try {
    b.view = std::make_unique<py::buffer_info>(
        py::reinterpret_borrow<py::buffer>(obj).request(write));
  } catch (py::error_already_set& e) {
    refuse(what + " cannot be used" + (write ? " for writing" : "") + ": " + e.what());
  }
  auto& v = *b.view;
  if (write && v.readonly) {
    refuse(what + " is read-only: roccl writes the result into it");
  }
  // C-contiguous: each stride is the product of the later dimensions' sizes.
  py::ssize_t expect = v.itemsize;
  for (py::ssize_t d = v.ndim - 1; d >= 0; --d) {
    if (v.shape[d] > 1 && v.strides[d] != expect) {
      refuse(what + " is not C-contiguous: pass a contiguous copy (numpy.ascontiguousarray)");
    }
    expect *= v.shape[d];
  }
  b.dtype = dtypeOfFormat(v.format, static_cast<size_t>(v.itemsize), what);
  b.dtypeName = v.format;
  b.addr = reinterpret_cast<size_t>(v.ptr);
  b.bytes = static_cast<size_t>(v.size) * static_cast<size_t>(v.itemsize);
  return b;
}

Reduction reductionOf(const std::string& op) {
  if (op == "sum") return Reduction::Sum;
  if (op == "prod") return Reduction::Prod;
  if (op == "max") return Reduction::Max;
  if (op == "min") return Reduction::Min;
  if (op == "avg") return Reduction::Avg;
  refuse("unknown reduction '" + op + "': use sum, prod, max, min or avg");
}

uint64_t millis(double seconds) {
  if (!(seconds >= 0)) {
    refuse("the timeout must be a number of seconds, 0 or more");
  }
  return static_cast<uint64_t>(seconds * 1000.0);
}

class PyCommunicator {
 public:
  PyCommunicator(const py::bytes& id, size_t nranks, size_t rank, double timeout)
      : comm_(join(id, nranks, rank, millis(timeout))) {}

  size_t rank() const {
    return comm_->rank();
  }
  size_t nranks() const {
    return comm_->nranks();
  }
  std::string netName() const {
    return std::string(comm_->net_name());
  }

  // In place on `buf` when `out` is None; else from `buf` into `out`.
  void run(
      Kind kind,
      py::handle input,
      py::handle output,
      const std::string& op,
      size_t root) {
    const bool inPlace = output.is_none();
    Buffer in = bufferOf(input, inPlace, inPlace ? "the buffer" : "the input");
    Buffer out;
    if (!inPlace) {
      out = bufferOf(output, true, "the output");
      if (out.dtype != in.dtype) {
        refuse(
            "the input (" + in.dtypeName + ") and the output (" + out.dtypeName +
            ") have different element types");
      }
    }
    const Reduction red = reductionOf(op);
    const Buffer& recv = inPlace ? in : out;
    try {
      py::gil_scoped_release nogil;
      comm_->collective(
          kind,
          in.dtype,
          red,
          root,
          inPlace ? 0 : in.addr,
          inPlace ? 0 : in.bytes,
          inPlace,
          recv.addr,
          recv.bytes,
          0);
    } catch (const rust::Error& e) {
      throw std::runtime_error(e.what());
    }
  }

  void point(bool send, py::handle buf, size_t peer) {
    Buffer b = bufferOf(buf, !send, send ? "the buffer to send" : "the buffer to receive into");
    bool flags[1] = {send};
    size_t peers[1] = {peer}, addrs[1] = {b.addr}, bytes[1] = {b.bytes};
    try {
      py::gil_scoped_release nogil;
      comm_->exchange(
          rust::Slice<const bool>(flags, 1),
          rust::Slice<const size_t>(peers, 1),
          rust::Slice<const size_t>(addrs, 1),
          rust::Slice<const size_t>(bytes, 1),
          0);
    } catch (const rust::Error& e) {
      throw std::runtime_error(e.what());
    }
  }

  void barrier() {
    try {
      py::gil_scoped_release nogil;
      comm_->collective(Kind::Barrier, Dtype::U8, Reduction::Sum, 0, 0, 0, true, 0, 0, 0);
    } catch (const rust::Error& e) {
      throw std::runtime_error(e.what());
    }
  }

  void abort() {
    comm_->abort();
  }

 private:
  static rust::Box<Comm> join(const py::bytes& id, size_t nranks, size_t rank, uint64_t ms) {
    std::string bytes = id;
    try {
      py::gil_scoped_release nogil;
      return ::roccl_torch::init(
          rust::Slice<const uint8_t>(
              reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
          nranks,
          rank,
          ms,
          false);
    } catch (const rust::Error& e) {
      throw std::runtime_error(e.what());
    }
  }

  rust::Box<Comm> comm_;
};

} // namespace

void bindCommunicator(py::module_& m) {
  m.def(
      "unique_id",
      [] {
        try {
          auto id = ::roccl_torch::unique_id();
          return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
        } catch (const rust::Error& e) {
          throw std::runtime_error(e.what());
        }
      },
      "A new unique id (this process serves its rendezvous): pass its bytes to every rank.");
  py::class_<PyCommunicator>(m, "Communicator", R"(roccl's collectives on numpy arrays, other
buffers (bytearray, array.array, memoryview) and CPU torch tensors, for programs that are not
torch.distributed programs. Every rank calls Communicator(unique_id, nranks, rank); calls
block until done; reductions are "sum", "prod", "max", "min", "avg".)")
      .def(
          py::init<const py::bytes&, size_t, size_t, double>(),
          py::arg("unique_id"),
          py::arg("nranks"),
          py::arg("rank"),
          py::arg("timeout") = 0.0,
          "Join: `timeout` in seconds (0: ROCCL_TIMEOUT).")
      .def_property_readonly("rank", &PyCommunicator::rank)
      .def_property_readonly("nranks", &PyCommunicator::nranks)
      .def_property_readonly("net_name", &PyCommunicator::netName)
      .def(
          "all_reduce",
          [](PyCommunicator& c, py::handle buf, const std::string& op, py::handle out) {
            c.run(Kind::AllReduce, buf, out, op, 0);
          },
          py::arg("buf"),
          py::arg("op") = "sum",
          py::arg("out") = py::none(),
          "Reduce `buf` over the ranks, in place (or into `out`).")
      .def(
          "broadcast",
          [](PyCommunicator& c, py::handle buf, size_t root) {
            c.run(Kind::Broadcast, buf, py::none(), "sum", root);
          },
          py::arg("buf"),
          py::arg("root") = 0)
      .def(
          "reduce",
          [](PyCommunicator& c, py::handle buf, size_t root, const std::string& op) {
            c.run(Kind::Reduce, buf, py::none(), op, root);
          },
          py::arg("buf"),
          py::arg("root") = 0,
          py::arg("op") = "sum")
      .def(
          "all_gather",
          [](PyCommunicator& c, py::handle send, py::handle recv) {
            c.run(Kind::AllGather, send, recv, "sum", 0);
          },
          py::arg("send"),
          py::arg("recv"),
          "Every rank's `send` into `recv`, in rank order (recv holds nranks × send).")
      .def(
          "reduce_scatter",
          [](PyCommunicator& c, py::handle send, py::handle recv, const std::string& op) {
            c.run(Kind::ReduceScatter, send, recv, op, 0);
          },
          py::arg("send"),
          py::arg("recv"),
          py::arg("op") = "sum")
      .def(
          "all_to_all",
          [](PyCommunicator& c, py::handle send, py::handle recv) {
            c.run(Kind::AllToAll, send, recv, "sum", 0);
          },
          py::arg("send"),
          py::arg("recv"))
      .def(
          "send",
          [](PyCommunicator& c, py::handle buf, size_t peer) { c.point(true, buf, peer); },
          py::arg("buf"),
          py::arg("peer"))
      .def(
          "recv",
          [](PyCommunicator& c, py::handle buf, size_t peer) { c.point(false, buf, peer); },
          py::arg("buf"),
          py::arg("peer"))
      .def("barrier", &PyCommunicator::barrier)
      .def(
          "abort",
          &PyCommunicator::abort,
          "Close the connections now: a call blocked on another thread raises.");
}

} // namespace roccl_torch
