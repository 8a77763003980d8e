// roccl's torch.distributed backend: a c10d::Backend over the Rust core (through the cxx
// bridge of ffi/torch/bridge). Every operation becomes a WorkRoccl: a list of steps (calls
// into roccl on tensor memory), point-to-point operations run together at the end, and
// copies back into the caller's tensors. Works run in issue order, on the process group's
// worker thread, or on the caller's thread when it waits for the next work in line (a
// blocking call runs at once, without a thread switch).
//
// Sends and receives issued one by one (isend/irecv, or batches of only those) are held
// back briefly and run together with the sends and receives queued right behind them, as
// one group: `isend(a, peer); irecv(b, peer); wait()` on both sides cannot deadlock, whatever
// the sizes. A held group starts when any work is waited for or polled, when a work of
// another kind is queued behind it, or after ROCCL_TORCH_P2P_HOLD_US (default 10 ms).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "roccl-torch/src/lib.rs.h"
#include "rust/cxx.h"

namespace c10d {
class ProcessGroup;
}

namespace roccl_torch {

class Queue;

// One point-to-point operation of a work (the tensor keeps its memory alive).
struct P2pOp {
  bool send;
  size_t peer;
  at::Tensor tensor;
};

class WorkRoccl : public c10d::Work {
 public:
  WorkRoccl(
      int rank,
      c10d::OpType type,
      const char* title,
      std::weak_ptr<Queue> queue);
  ~WorkRoccl() override = default;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  void abort() override;

  // Run the steps, the point-to-point operations and the copies back, then complete.
  void execute(const Comm& comm);
  // Complete the future (its callbacks run here): called once the queue is free again.
  void publish();
  // Complete with an error without running (the process group was aborted or shut down).
  void fail(const std::string& why);

  // Run `works` (each only sends and receives) as one group of sends and receives, then
  // complete each of them.
  static void executeTogether(
      const std::vector<c10::intrusive_ptr<WorkRoccl>>& works,
      const Comm& comm);

  // What the work does, filled in before it is submitted.
  // Each step gets the work's timeout in ms (0: the process group's).
  std::vector<std::function<void(const Comm&, uint64_t)>> steps;
  std::vector<P2pOp> p2p;
  std::vector<std::function<void()>> finish;
  std::vector<at::Tensor> outputs;
  std::string name;
  // Only sends and receives, issued on their own: may be held back and grouped with the
  // sends and receives behind it (see the top of this file).
  bool mergeable = false;
  std::chrono::steady_clock::time_point queuedAt;
  // The operation's own timeout (c10d's per-operation option), or kUnsetTimeout.
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout;
  uint64_t timeoutMs() const {
    return timeout.count() > 0 ? static_cast<uint64_t>(timeout.count()) : 0;
  }

 private:
  void complete(std::exception_ptr error);
  void markFuture(
      const c10::intrusive_ptr<c10::ivalue::Future>& future,
      std::exception_ptr error);

  std::weak_ptr<Queue> queue_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  bool published_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The works of one process group, in issue order, and the thread that runs them.
class Queue {
 public:
  Queue(rust::Box<Comm> comm);
  ~Queue();

  // Queue `w`; with `async == false` run it on this thread when it is next in line.
  void submit(const c10::intrusive_ptr<WorkRoccl>& w, bool async);
  // Run `w` on this thread if it is the next work (or in the group of held sends and
  // receives at the front) and none is running; true if it ran.
  bool runIfNext(WorkRoccl* w);
  // A blocking call's fast path: with nothing queued or running, run `w` (never queued)
  // on this thread now and complete it; false (nothing done) when other works are ahead.
  bool runAlone(WorkRoccl& w);
  // The call without a work (torch.ops.roccl.all_reduce_): with nothing queued or running,
  // run `f` on this thread now (what it throws is thrown here); false (nothing done) when
  // other works are ahead or the queue is closed.
  bool runNow(c10::function_ref<void(const Comm&)> f);
  // Someone waits for or polls a work: held sends and receives start now. `waiting`: a
  // wait begins (+1) or ends (-1); held groups start at once while any wait is on.
  void hurry(int waiting = 0);
  // Wait until every queued work has run, then stop the worker thread.
  void shutdown();
  // Close roccl's connections (a running work fails), fail the queued works, stop.
  void abort();
  const Comm& comm() const {
    return *comm_;
  }
  size_t pending();

 private:
  void loop();
  void stopWorker();
  // With the lock held: the works to run next (the front one, or the group of held sends
  // and receives at the front, which must contain `upTo` when given), or none when the
  // front group may still wait for more.
  std::vector<c10::intrusive_ptr<WorkRoccl>> takeLocked(
      WorkRoccl* upTo,
      bool force,
      std::chrono::steady_clock::time_point* due);
  // Run what takeLocked returned, on this thread, then publish it (the lock not held).
  void runTaken(std::vector<c10::intrusive_ptr<WorkRoccl>>& taken);

  rust::Box<Comm> comm_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<c10::intrusive_ptr<WorkRoccl>> works_;
  bool running_ = false;
  bool stopping_ = false;
  bool hurried_ = false;  // a work was polled: held sends and receives start
  int waiters_ = 0;  // waits in progress
  std::chrono::microseconds hold_;  // how long sends and receives may be held
  std::string closed_;  // why no more works are taken, once closed
  std::thread worker_;
};

class ProcessGroupRoccl : public c10d::Backend {
 public:
  ProcessGroupRoccl(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      bool deterministic = false);
  ~ProcessGroupRoccl() override;

  const std::string getBackendName() const override {
    return "roccl";
  }
  c10::intrusive_ptr<Backend::Options> getBackendOptions() override {
    return options_;
  }
  bool supportsCoalescing() const override {
    return true;
  }
  bool supportsSplitting() const override {
    return true;
  }
  // The number of collectives this group has issued (every rank issues them alike; sends
  // and receives do not count), as torch's debug wrapper compares across ranks.
  void setSequenceNumberForGroup() override {
    sequence_.store(0);
  }
  uint64_t getSequenceNumberForGroup() override {
    return sequence_.load();
  }
  std::string netName() const;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts =
          c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  // torch's monitored_barrier (monitored.cpp): through the group's Store, so that rank 0
  // names the ranks that did not arrive within the timeout without breaking the group.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false)
      override;

  // torch.ops.roccl.all_reduce_ (fastpath.cpp): a blocking all-reduce of `t` in place,
  // without a work object when nothing is queued; otherwise (or for what the direct call
  // does not take: PREMUL_SUM, a tensor that is not contiguous, an open coalescing block) as
  // allreduce() and wait.
  void allReduceNow(at::Tensor& t, const c10d::AllreduceOptions& opts);

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Backend::Options>& opts) override;

  void abort() override;
  void shutdown() override;

 private:
  // A new work, or the open coalesced one.
  c10::intrusive_ptr<WorkRoccl> work(c10d::OpType type, const char* title);
  // Queue `w` unless it is the open coalesced work; `timeout`: the operation's own.
  c10::intrusive_ptr<c10d::Work> submit(
      const c10::intrusive_ptr<WorkRoccl>& w,
      bool async,
      std::chrono::milliseconds timeout = c10d::kUnsetTimeout);

  c10::intrusive_ptr<Backend::Options> options_;
  // The group's Store (torch's): the unique id at init, monitored barriers later.
  c10::intrusive_ptr<c10d::Store> store_;
  // Monitored barriers this rank has entered (names each one's keys in the Store).
  uint64_t monitored_ = 0;
  std::shared_ptr<Queue> queue_;
  std::atomic<uint64_t> sequence_{0};
  c10::intrusive_ptr<WorkRoccl> coalesced_;
};

// roccl._C._all_reduce_direct (fastpath.cpp): a blocking all-reduce of `tensor` in place
// when `pg`'s backend for its device is roccl (then true); false, and nothing done, when not.
bool allReduceDirect(at::Tensor& tensor, c10d::ProcessGroup& pg, int64_t op);

// Raise c10::DistBackendError with `msg` (what Python sees as DistBackendError).
[[noreturn]] void raise(const std::string& msg);

// roccl's data type for `t` (refused with a message naming `op` when roccl has none).
Dtype dtypeOf(const at::Tensor& t, const std::string& op);

} // namespace roccl_torch
