// torch's monitored_barrier on roccl's process group. Gloo's runs over Gloo's own
// connections; this one runs over the group's Store (torch's), so that a rank that never
// arrives is named by rank 0 without breaking roccl's connections, and the group stays
// usable. Every rank but 0 sets its "arrived" key and waits for rank 0's verdict; rank 0
// waits for each rank's key in turn (all of them with waitAllRanks), within the timeout,
// then publishes the verdict. The errors are worded as Gloo's, which torch's tests and
// users' log searches know.

#include <chrono>
#include <string>
#include <vector>

#include "backend.hpp"

namespace roccl_torch {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Whether `key` appears in `store` within `wait` (the Store's own wait, which throws when it
// does not; a zero wait means "no limit" to a Store, so at least 1 ms is asked).
bool appears(c10d::Store& store, const std::string& key, milliseconds wait) {
  if (store.check({key})) {
    return true;
  }
  if (wait.count() <= 0) {
    return false;
  }
  try {
    store.wait({key}, std::max(wait, milliseconds(1)));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::string joined(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return out;
}

} // namespace

void ProcessGroupRoccl::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const milliseconds timeout =
      opts.timeout == c10d::kUnsetTimeout ? options_->timeout : opts.timeout;
  const int rank = getRank();
  const int size = getSize();
  const std::string base = "roccl/monitored_barrier/" + std::to_string(monitored_++) + "/";
  const std::string verdict = base + "verdict";
  const auto start = Clock::now();
  auto left = [&] {
    return timeout - std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  };
  if (rank != 0) {
    store_->set(base + "arrived/" + std::to_string(rank), std::vector<uint8_t>{1});
    // Rank 0 may have entered later and judge up to its timeout after that: wait twice as
    // long for its verdict before giving up on it.
    bool ok = appears(*store_, verdict, left() + timeout);
    if (ok) {
      auto v = store_->get(verdict);
      ok = !v.empty() && v[0] == 1;
    }
    if (!ok) {
      raise(
          "Rank " + std::to_string(rank) +
          " successfully reached monitoredBarrier, but received errors while waiting for "
          "send/recv from rank 0. Please check rank 0 logs for faulty rank.");
    }
    return;
  }
  std::vector<int> missing;
  for (int r = 1; r < size; ++r) {
    if (left().count() <= 0 && missing.empty() &&
        !store_->check({base + "arrived/" + std::to_string(r)})) {
      store_->set(verdict, std::vector<uint8_t>{0});
      raise(
          "Rank 0 timed out in monitoredBarrier after " + std::to_string(timeout.count()) +
          " ms.");
    }
    if (!appears(*store_, base + "arrived/" + std::to_string(r), left())) {
      missing.push_back(r);
      if (!waitAllRanks) {
        break;
      }
    }
  }
  if (!missing.empty()) {
    store_->set(verdict, std::vector<uint8_t>{0});
    raise(
        std::string(missing.size() == 1 ? "Rank " : "Ranks ") + joined(missing) +
        " failed to pass monitoredBarrier in " + std::to_string(timeout.count()) +
        " ms");
  }
  store_->set(verdict, std::vector<uint8_t>{1});
}

} // namespace roccl_torch
