// Works, the queue that runs them in order, and the process group's life: bootstrap through
// torch's Store, coalescing, split, abort and shutdown. The collectives are in ops.cpp.
#include "backend.hpp"

#include <cstdlib>

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
  if (done_.load(std::memory_order_acquire)) {
    return true;
  }
  // Polled: held sends and receives must start (the caller may poll in a loop).
  if (mergeable) {
    if (auto queue = queue_.lock()) {
      queue->hurry();
    }
  }
  return false;
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

namespace {

// Run `ops` as one group of sends and receives (`timeoutMs`: 0 for the group's timeout).
void runExchange(
    const Comm& comm,
    const std::vector<const P2pOp*>& ops,
    uint64_t timeoutMs) {
  if (ops.empty()) {
    return;
  }
  std::vector<size_t> peers, addrs, bytes;
  // std::vector<bool> has no data(): a plain array.
  std::unique_ptr<bool[]> sends(new bool[ops.size()]);
  for (size_t i = 0; i < ops.size(); ++i) {
    sends[i] = ops[i]->send;
    peers.push_back(ops[i]->peer);
    addrs.push_back(reinterpret_cast<size_t>(ops[i]->tensor.data_ptr()));
    bytes.push_back(ops[i]->tensor.numel() * ops[i]->tensor.element_size());
  }
  comm.exchange(
      rust::Slice<const bool>(sends.get(), ops.size()),
      rust::Slice<const size_t>(peers.data(), peers.size()),
      rust::Slice<const size_t>(addrs.data(), addrs.size()),
      rust::Slice<const size_t>(bytes.data(), bytes.size()),
      timeoutMs);
}

// Run `f`; what it throws, as the exception a work completes with.
template <class F>
std::exception_ptr guarded(const std::string& name, F f) {
  try {
    f();
  } catch (const rust::Error& e) {
    return errorOf(e.what());
  } catch (const c10::Error&) {
    return std::current_exception();
  } catch (const std::exception& e) {
    return errorOf(std::string("roccl: ") + name + ": " + e.what());
  } catch (...) {
    return errorOf(std::string("roccl: ") + name + ": unknown C++ exception");
  }
  return nullptr;
}

} // namespace

void WorkRoccl::execute(const Comm& comm) {
  complete(guarded(name, [&] {
    for (auto& step : steps) {
      step(comm, timeoutMs());
    }
    std::vector<const P2pOp*> ops;
    for (auto& op : p2p) {
      ops.push_back(&op);
    }
    runExchange(comm, ops, timeoutMs());
    for (auto& f : finish) {
      f();
    }
  }));
}

void WorkRoccl::executeTogether(
    const std::vector<c10::intrusive_ptr<WorkRoccl>>& works,
    const Comm& comm) {
  if (works.size() == 1) {
    works[0]->execute(comm);
    return;
  }
  std::vector<const P2pOp*> ops;
  for (auto& w : works) {
    for (auto& op : w->p2p) {
      ops.push_back(&op);
    }
  }
  auto error = guarded(works[0]->name, [&] { runExchange(comm, ops, works[0]->timeoutMs()); });
  for (auto& w : works) {
    if (error) {
      w->complete(error);
      continue;
    }
    w->complete(guarded(w->name, [&] {
      for (auto& f : w->finish) {
        f();
      }
    }));
  }
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
  if (!markNow && mergeable) {
    if (auto queue = queue_.lock()) {
      queue->hurry();
    }
  }
  if (markNow) {
    markFuture(future, error);
  }
  return future;
}

bool WorkRoccl::wait(std::chrono::milliseconds timeout) {
  std::shared_ptr<Queue> queue;
  if (!done_.load(std::memory_order_acquire)) {
    queue = queue_.lock();
    // Next in line with nothing running: run it here, without a thread switch; else the
    // worker runs it, held sends and receives included.
    if (queue && !queue->runIfNext(this)) {
      queue->hurry(+1);
    } else {
      queue.reset();
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  bool finished = true;
  if (timeout == kNoTimeout || timeout.count() < 0) {
    cv_.wait(lock, [&] { return done_.load(); });
  } else {
    finished = cv_.wait_for(lock, timeout, [&] { return done_.load(); });
  }
  lock.unlock();
  if (queue) {
    queue->hurry(-1);
  }
  if (!finished) {
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

namespace {

std::chrono::microseconds holdFromEnv() {
  const char* v = std::getenv("ROCCL_TORCH_P2P_HOLD_US");
  if (v == nullptr || *v == '\0') {
    return std::chrono::microseconds(10000);
  }
  char* end = nullptr;
  long long us = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || us < 0) {
    raise(
        std::string("roccl: ROCCL_TORCH_P2P_HOLD_US=") + v +
        " is not a number of microseconds (0 or more)");
  }
  return std::chrono::microseconds(us);
}

// Most sends and receives grouped into one exchange.
constexpr size_t kMaxGroup = 64;

} // namespace

Queue::Queue(rust::Box<Comm> comm)
    : comm_(std::move(comm)), hold_(holdFromEnv()) {
  worker_ = std::thread([this] { loop(); });
}

Queue::~Queue() {
  shutdown();
}

std::vector<c10::intrusive_ptr<WorkRoccl>> Queue::takeLocked(
    WorkRoccl* upTo,
    bool force,
    std::chrono::steady_clock::time_point* due) {
  std::vector<c10::intrusive_ptr<WorkRoccl>> taken;
  if (running_ || works_.empty()) {
    return taken;
  }
  if (!works_.front()->mergeable) {
    if (upTo == nullptr || works_.front().get() == upTo) {
      taken.push_back(works_.front());
      works_.pop_front();
    }
    return taken;
  }
  // The group of sends and receives at the front.
  size_t n = 0, ops = 0;
  bool hasUpTo = upTo == nullptr, closed = false;
  while (n < works_.size()) {
    auto& w = works_[n];
    if (!w->mergeable) {
      closed = true; // a work of another kind is behind: the group is complete
      break;
    }
    if (n > 0 && ops + w->p2p.size() > kMaxGroup) {
      closed = true;
      break;
    }
    ops += w->p2p.size();
    hasUpTo = hasUpTo || w.get() == upTo;
    ++n;
  }
  if (!hasUpTo) {
    return taken;
  }
  auto start = works_.front()->queuedAt + hold_;
  if (!(force || closed || stopping_ || hurried_ || waiters_ > 0 ||
        std::chrono::steady_clock::now() >= start)) {
    if (due != nullptr) {
      *due = start;
    }
    return taken;
  }
  hurried_ = false;
  for (size_t i = 0; i < n; ++i) {
    taken.push_back(works_.front());
    works_.pop_front();
  }
  return taken;
}

void Queue::runTaken(std::vector<c10::intrusive_ptr<WorkRoccl>>& taken) {
  WorkRoccl::executeTogether(taken, *comm_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    if (!works_.empty() || stopping_) {
      wake_.notify_one();
    }
  }
  for (auto& w : taken) {
    w->publish();
  }
  taken.clear();
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
    auto due = std::chrono::steady_clock::time_point::max();
    auto taken = takeLocked(nullptr, false, &due);
    if (taken.empty()) {
      // Held sends and receives: until they are due, hurried, or joined by other work.
      wake_.wait_until(lock, due);
      continue;
    }
    running_ = true;
    lock.unlock();
    runTaken(taken);
    lock.lock();
  }
}

void Queue::submit(const c10::intrusive_ptr<WorkRoccl>& w, bool async) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!closed_.empty()) {
      raise("roccl: " + w->name + ": " + closed_);
    }
    w->queuedAt = std::chrono::steady_clock::now();
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

bool Queue::runAlone(WorkRoccl& w) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ || !works_.empty() || !closed_.empty()) {
      return false;
    }
    running_ = true;
  }
  w.execute(*comm_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    if (!works_.empty() || stopping_) {
      wake_.notify_one();
    }
  }
  w.publish();
  return true;
}

bool Queue::runNow(c10::function_ref<void(const Comm&)> f) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ || !works_.empty() || !closed_.empty()) {
      return false;
    }
    running_ = true;
  }
  // Whatever `f` throws, the queue is free again afterwards.
  struct Release {
    Queue& q;
    ~Release() {
      std::lock_guard<std::mutex> lock(q.mutex_);
      q.running_ = false;
      if (!q.works_.empty() || q.stopping_) {
        q.wake_.notify_one();
      }
    }
  } release{*this};
  try {
    f(*comm_);
  } catch (const rust::Error& e) {
    raise(e.what());
  }
  return true;
}

bool Queue::runIfNext(WorkRoccl* w) {
  std::vector<c10::intrusive_ptr<WorkRoccl>> taken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    taken = takeLocked(w, true, nullptr);
    if (taken.empty()) {
      return false;
    }
    running_ = true;
  }
  runTaken(taken);
  return true;
}

void Queue::hurry(int waiting) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiters_ += waiting;
  if (waiting >= 0) {
    hurried_ = true;
  }
  wake_.notify_one();
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
    std::chrono::milliseconds timeout,
    bool deterministic)
    : Backend(rank, size),
      options_(c10::make_intrusive<Backend::Options>("roccl", timeout)),
      store_(store) {
  const std::string key = "roccl/unique_id";
  std::vector<uint8_t> id;
  try {
    if (rank == 0) {
      // Only the id's public part goes into the Store (its readers are not authenticated);
      // the secret is ROCCL_JOB_SECRET, which init_published adds on every rank.
      auto bytes = ::roccl_torch::store_id();
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
    auto comm = ::roccl_torch::init_published(
        rust::Slice<const uint8_t>(id.data(), id.size()),
        size,
        rank,
        static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)),
        deterministic);
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
  if (type != c10d::OpType::SEND && type != c10d::OpType::RECV &&
      type != c10d::OpType::RECVANYSOURCE) {
    sequence_.fetch_add(1);
  }
  return c10::make_intrusive<WorkRoccl>(getRank(), type, title, queue_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRoccl::submit(
    const c10::intrusive_ptr<WorkRoccl>& w,
    bool async,
    std::chrono::milliseconds timeout) {
  if (timeout != c10d::kUnsetTimeout &&
      (w->timeout == c10d::kUnsetTimeout || timeout < w->timeout)) {
    w->timeout = timeout; // a coalesced work takes the shortest of its operations'
  }
  if (w.get() != coalesced_.get()) {
    // A blocking call with nothing ahead of it runs here and now: no queue entry.
    if (!async && queue_->runAlone(*w)) {
      return w;
    }
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
  // A batch of only sends and receives (batch_isend_irecv) may join the ones around it.
  w->mergeable = w->steps.empty() && !w->p2p.empty();
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
