// Works, the queue that runs them in order, and the process group's life: bootstrap through
// torch's Store, coalescing, split, abort and shutdown. The collectives are in ops.cpp.
#include "backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

namespace roccl_torch {

void raise(const std::string& msg) {
  C10_THROW_ERROR(DistBackendError, msg);
}

namespace {

// The queue whose worker thread this is (null on other threads).
thread_local const Queue* workerOf = nullptr;

std::exception_ptr errorOf(const std::string& msg) {
  try {
    raise(msg);
  } catch (...) {
    return std::current_exception();
  }
}

} // namespace

// ---------------------------------------------------------------------------------------
// WorkRoccl

WorkRoccl::WorkRoccl(
    int rank,
    c10d::OpType type,
    const char* title,
    std::weak_ptr<Queue> queue)
    : c10d::Work(rank, type), name(title), queue_(std::move(queue)) {}

bool WorkRoccl::isCompleted() {
  return done_.load(std::memory_order_acquire);
}

bool WorkRoccl::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_.load() && !error_;
}

std::exception_ptr WorkRoccl::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

std::vector<at::Tensor> WorkRoccl::result() {
  return outputs;
}

void WorkRoccl::execute(const Comm& comm) {
  std::exception_ptr error;
  try {
    for (auto& step : steps) {
      step(comm);
    }
    if (!p2p.empty()) {
      std::vector<bool> sends;
      std::vector<size_t> peers, addrs, bytes;
      for (auto& op : p2p) {
        sends.push_back(op.send);
        peers.push_back(op.peer);
        addrs.push_back(reinterpret_cast<size_t>(op.tensor.data_ptr()));
        bytes.push_back(op.tensor.numel() * op.tensor.element_size());
      }
      // std::vector<bool> has no data(): copy into a plain array.
      std::unique_ptr<bool[]> flags(new bool[sends.size()]);
      for (size_t i = 0; i < sends.size(); ++i) {
        flags[i] = sends[i];
      }
      comm.exchange(
          rust::Slice<const bool>(flags.get(), sends.size()),
          rust::Slice<const size_t>(peers.data(), peers.size()),
          rust::Slice<const size_t>(addrs.data(), addrs.size()),
          rust::Slice<const size_t>(bytes.data(), bytes.size()));
    }
    for (auto& f : finish) {
      f();
    }
  } catch (const rust::Error& e) {
    error = errorOf(e.what());
  } catch (const c10::Error& e) {
    error = std::current_exception();
  } catch (const std::exception& e) {
    error = errorOf(std::string("roccl: ") + name + ": " + e.what());
  } catch (...) {
    error = errorOf(std::string("roccl: ") + name + ": unknown C++ exception");
  }
  complete(error);
}

void WorkRoccl::fail(const std::string& why) {
  complete(errorOf(why));
  publish();
}

void WorkRoccl::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_.load()) {
      return;
    }
    error_ = error;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void WorkRoccl::publish() {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (published_) {
      return;
    }
    published_ = true;
    future = future_;
    error = error_;
  }
  // The future's callbacks run here, with the queue free: they may issue and wait for
  // more collectives.
  if (future) {
    markFuture(future, error);
  }
}

void WorkRoccl::markFuture(
    const c10::intrusive_ptr<c10::ivalue::Future>& future,
    std::exception_ptr error) {
  if (error) {
    future->setError(error);
  } else {
    future->markCompleted(c10::IValue(outputs));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> WorkRoccl::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool markNow = false;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()));
      markNow = published_;
      error = error_;
    }
    future = future_;
  }
  if (markNow) {
    markFuture(future, error);
  }
  return future;
}

bool WorkRoccl::wait(std::chrono::milliseconds timeout) {
  if (!done_.load(std::memory_order_acquire)) {
    // Next in line with nothing running: run it here, without a thread switch.
    if (auto queue = queue_.lock()) {
      queue->runIfNext(this);
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == kNoTimeout || timeout.count() < 0) {
    cv_.wait(lock, [&] { return done_.load(); });
  } else if (!cv_.wait_for(lock, timeout, [&] { return done_.load(); })) {
    raise(
        "roccl: " + name + " did not complete within " +
        std::to_string(timeout.count()) +
        " ms (the wait's timeout; roccl's own timeout is the one given to init_process_group)");
  }
  if (error_) {
    std::rethrow_exception(error_);
  }
  return true;
}

void WorkRoccl::abort() {
  if (auto queue = queue_.lock()) {
    queue->abort();
  }
}

// ---------------------------------------------------------------------------------------
// Queue

Queue::Queue(rust::Box<Comm> comm) : comm_(std::move(comm)) {
  worker_ = std::thread([this] { loop(); });
}

Queue::~Queue() {
  shutdown();
}

void Queue::loop() {
  workerOf = this;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(
        lock, [&] { return !running_ && (stopping_ || !works_.empty()); });
    if (works_.empty()) {
      return; // stopping, and every queued work has run
    }
    auto w = works_.front();
    works_.pop_front();
    running_ = true;
    lock.unlock();
    w->execute(*comm_);
    lock.lock();
    running_ = false;
    lock.unlock();
    w->publish();
    w.reset();
    lock.lock();
  }
}

void Queue::submit(const c10::intrusive_ptr<WorkRoccl>& w, bool async) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!closed_.empty()) {
      raise("roccl: " + w->name + ": " + closed_);
    }
    works_.push_back(w);
    // A call from a future's callback on the worker thread runs at once (the worker
    // cannot run it while the callback waits for it).
    if (async && workerOf != this) {
      wake_.notify_one();
      return;
    }
  }
  if (!runIfNext(w.get())) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_one();
  }
}

bool Queue::runIfNext(WorkRoccl* w) {
  c10::intrusive_ptr<WorkRoccl> keep;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ || works_.empty() || works_.front().get() != w) {
      return false;
    }
    keep = works_.front();
    works_.pop_front();
    running_ = true;
  }
  keep->execute(*comm_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    if (!works_.empty() || stopping_) {
      wake_.notify_one();
    }
  }
  keep->publish();
  return true;
}

size_t Queue::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return works_.size() + (running_ ? 1 : 0);
}

void Queue::stopWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    wake_.notify_all();
  }
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) {
    worker_.join();
  } else if (worker_.joinable()) {
    worker_.detach();
  }
}

void Queue::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_.empty()) {
      closed_ = "the process group was shut down";
    }
  }
  // Queued works still run (each within roccl's timeout): the worker drains, then stops.
  stopWorker();
}

void Queue::abort() {
  comm_->abort();
  std::deque<c10::intrusive_ptr<WorkRoccl>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = "the process group was aborted";
    dropped.swap(works_);
  }
  for (auto& w : dropped) {
    w->fail("roccl: " + w->name + ": the process group was aborted before it ran");
  }
  stopWorker();
}

// ---------------------------------------------------------------------------------------
// ProcessGroupRoccl: life

ProcessGroupRoccl::ProcessGroupRoccl(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)
    : Backend(rank, size),
      options_(c10::make_intrusive<Backend::Options>("roccl", timeout)) {
  const std::string key = "roccl/unique_id";
  std::vector<uint8_t> id;
  try {
    if (rank == 0) {
      auto bytes = ::roccl_torch::unique_id();
      id.assign(bytes.begin(), bytes.end());
      store->set(key, id);
    } else {
      store->wait({key}, timeout);
      id = store->get(key);
    }
  } catch (const rust::Error& e) {
    raise(e.what());
  } catch (const std::exception& e) {
    raise(
        std::string("roccl rank ") + std::to_string(rank) +
        ": reading rank 0's unique id from torch's Store failed (is rank 0 up and in the same group?): " +
        e.what());
  }
  try {
    auto comm = ::roccl_torch::init(
        rust::Slice<const uint8_t>(id.data(), id.size()),
        size,
        rank,
        static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)));
    queue_ = std::make_shared<Queue>(std::move(comm));
  } catch (const rust::Error& e) {
    raise(e.what());
  }
}

ProcessGroupRoccl::~ProcessGroupRoccl() {
  if (queue_) {
    queue_->shutdown();
  }
}

std::string ProcessGroupRoccl::netName() const {
  return std::string(queue_->comm().net_name());
}

void ProcessGroupRoccl::abort() {
  queue_->abort();
}

void ProcessGroupRoccl::shutdown() {
  queue_->shutdown();
}

c10::intrusive_ptr<WorkRoccl> ProcessGroupRoccl::work(
    c10d::OpType type,
    const char* title) {
  if (coalesced_) {
    return coalesced_;
  }
  return c10::make_intrusive<WorkRoccl>(getRank(), type, title, queue_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::submit(
    const c10::intrusive_ptr<WorkRoccl>& w,
    bool async) {
  if (w.get() != coalesced_.get()) {
    queue_->submit(w, async);
  }
  return w;
}

void ProcessGroupRoccl::startCoalescing() {
  TORCH_CHECK(
      !coalesced_,
      "roccl: startCoalescing was called twice without endCoalescing");
  coalesced_ = c10::make_intrusive<WorkRoccl>(
      getRank(), c10d::OpType::COALESCED, "roccl:coalesced", queue_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::endCoalescing() {
  TORCH_CHECK(
      coalesced_, "roccl: endCoalescing was called without startCoalescing");
  auto w = std::move(coalesced_);
  coalesced_.reset();
  queue_->submit(w, true);
  return w;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupRoccl::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Backend::Options>& opts) {
  auto it = std::find(ranks.begin(), ranks.end(), getRank());
  if (it == ranks.end()) {
    return nullptr;
  }
  auto timeout = opts ? opts->timeout : options_->timeout;
  return c10::make_intrusive<ProcessGroupRoccl>(
      store,
      static_cast<int>(it - ranks.begin()),
      static_cast<int>(ranks.size()),
      timeout);
}

} // namespace roccl_torch
