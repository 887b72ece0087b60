// Host-side rendezvous of the peer-copy all-to-all (jtbo/collectives/peer_copy.py).
//
// One exchange is a "slot" shared by the devices of its group. Every device's start call
// joins the slot with its send and receive buffers (and, on a GPU, an event recorded on its
// compute stream); when all have joined, each device pushes its blocks into the peers'
// receive buffers and marks its pushes issued. Every device's wait call finds the slot again
// by its receive buffer's address (XLA hands the same buffer from start to wait, since the
// wait aliases it), waits until all devices have issued their pushes, and leaves; the last
// one to leave retires the slot.
//
// Starts are matched across devices by (run id, how many starts this device has made in the
// run): every device runs the same compiled program, so its k-th start is everyone's k-th.
//
// A staged exchange (JTBO_PEER_COPY_VIA_HOST=1, read at every start) moves the blocks through
// host memory instead, as an inter-host link would: each device first copies its whole send
// buffer into a host staging buffer and marks it staged; once every device has, each device
// copies the blocks addressed to it from the peers' staging buffers into its own receive
// buffer, and marks those copies issued ("pushed"). The devices of one exchange must agree
// on the mode.
#ifndef JTBO_FFI_PEER_EXCHANGE_H_
#define JTBO_FFI_PEER_EXCHANGE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace jtbo {

// How long a device waits for its peers before the call fails (a peer that never arrives
// means the devices did not run the same program, or one of them failed).
constexpr std::chrono::seconds kPeerTimeout{120};

struct ExchangeSlot {
  explicit ExchangeSlot(int group_size)
      : send(group_size),
        recv(group_size),
        ready(group_size),
        done(group_size),
        staging(group_size),
        staged(group_size) {}
  std::vector<const void*> send;  // per rank: its send buffer
  std::vector<void*> recv;        // per rank: its receive buffer
  std::vector<void*> ready;       // per rank: event after its inputs (GPU), else null
  std::vector<void*> done;        // per rank: event after its pushes (GPU), else null
  std::vector<void*> staging;     // per rank, staged exchanges: its send buffer's host copy
  std::vector<void*> staged;      // per rank, staged: event after that copy (GPU), else null
  int64_t bytes = -1;             // every rank's buffer size
  bool via_host = false;          // a staged exchange (every rank's staging set)
  int joined = 0;                 // ranks that joined
  int staged_count = 0;           // ranks whose copy into `staging` is issued
  int pushed = 0;                 // ranks whose pushes are issued
  int left = 0;                   // ranks whose wait has finished
};

class ExchangeRegistry {
 public:
  // Joins this device's slot of the run's next exchange and blocks until the whole group has
  // joined (`staging`: this device's host staging buffer for a staged exchange, else null).
  // Returns the slot, or null with `error` set.
  std::shared_ptr<ExchangeSlot> Join(int64_t run_id, int device, int rank, int group_size,
                                     int64_t bytes, const void* send, void* recv, void* ready,
                                     void* staging, std::string* error) {
    std::unique_lock<std::mutex> lock(mu_);
    int64_t occurrence = NextStart(device, run_id);
    auto key = std::make_pair(run_id, occurrence);
    auto& slot = slots_[key];
    if (!slot) slot = std::make_shared<ExchangeSlot>(group_size);
    std::shared_ptr<ExchangeSlot> joined = slot;
    if (static_cast<int>(joined->recv.size()) != group_size ||
        (joined->bytes >= 0 && joined->bytes != bytes)) {
      *error = "peer all-to-all: devices disagree on the exchange (group of " +
               std::to_string(group_size) + ", " + std::to_string(bytes) +
               " bytes here); they are not running the same program";
      return nullptr;
    }
    if (joined->joined > 0 && joined->via_host != (staging != nullptr)) {
      *error = "peer all-to-all: devices disagree on staging through host memory "
               "(JTBO_PEER_COPY_VIA_HOST differs between their starts)";
      return nullptr;
    }
    joined->bytes = bytes;
    joined->via_host = staging != nullptr;
    joined->staging[rank] = staging;
    joined->send[rank] = send;
    joined->recv[rank] = recv;
    joined->ready[rank] = ready;
    joined->joined += 1;
    by_recv_[{device, recv}] = joined;
    changed_.notify_all();
    if (!changed_.wait_for(lock, kPeerTimeout, [&] { return joined->joined == group_size; })) {
      *error = "peer all-to-all: a peer device did not reach the exchange within " +
               std::to_string(kPeerTimeout.count()) + " s";
      return nullptr;
    }
    if (joined->joined == group_size) slots_.erase(key);  // matched; waits find it by buffer
    return joined;
  }

  // Staged exchanges: records that `rank` has issued the copy of its send buffer into its
  // staging buffer (`staged`: an event after it, or null), then blocks until every rank has.
  // Returns false with `error` set if a peer never does.
  bool StageAndAwait(ExchangeSlot& slot, int rank, void* staged, std::string* error) {
    std::unique_lock<std::mutex> lock(mu_);
    slot.staged[rank] = staged;
    slot.staged_count += 1;
    changed_.notify_all();
    const int group_size = static_cast<int>(slot.recv.size());
    if (!changed_.wait_for(lock, kPeerTimeout, [&] { return slot.staged_count == group_size; })) {
      *error = "peer all-to-all: a peer device did not stage its buffer within " +
               std::to_string(kPeerTimeout.count()) + " s";
      return false;
    }
    return true;
  }

  // Records that `rank` has issued its pushes (`done`: an event after them, or null).
  void MarkPushed(ExchangeSlot& slot, int rank, void* done) {
    std::lock_guard<std::mutex> lock(mu_);
    slot.done[rank] = done;
    slot.pushed += 1;
    changed_.notify_all();
  }

  // Finds the slot whose receive buffer on `device` is `recv` and blocks until every rank has
  // issued its pushes. Returns null with `error` set if there is none.
  std::shared_ptr<ExchangeSlot> AwaitPushes(int device, void* recv, std::string* error) {
    std::unique_lock<std::mutex> lock(mu_);
    auto found = by_recv_.find({device, recv});
    if (found == by_recv_.end()) {
      *error = "peer all-to-all wait: no exchange was started into this buffer (XLA moved "
               "the receive buffer between start and wait, or the start failed)";
      return nullptr;
    }
    std::shared_ptr<ExchangeSlot> slot = found->second;
    const int group_size = static_cast<int>(slot->recv.size());
    if (!changed_.wait_for(lock, kPeerTimeout, [&] { return slot->pushed == group_size; })) {
      *error = "peer all-to-all wait: a peer device did not issue its copies within " +
               std::to_string(kPeerTimeout.count()) + " s";
      return nullptr;
    }
    return slot;
  }

  // This device's wait is finished. Returns true for the last device of the group: it owns
  // the slot's events now (no other device reads them any more).
  bool Leave(int device, void* recv, ExchangeSlot& slot) {
    std::lock_guard<std::mutex> lock(mu_);
    by_recv_.erase({device, recv});
    slot.left += 1;
    return slot.left == static_cast<int>(slot.recv.size());
  }

 private:
  // Keeps the start counters of the last runs only; a run that many runs old has finished.
  static constexpr size_t kRunsKept = 4096;

  int64_t NextStart(int device, int64_t run_id) {
    auto [counter, inserted] = starts_.try_emplace({device, run_id}, 0);
    if (inserted) {
      counted_.push_back(counter->first);
      if (counted_.size() > kRunsKept) {
        starts_.erase(counted_.front());
        counted_.pop_front();
      }
    }
    return counter->second++;
  }

  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::pair<int, int64_t>, int64_t> starts_;  // (device, run) -> starts so far
  std::deque<std::pair<int, int64_t>> counted_;        // starts_'s keys, oldest first
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<ExchangeSlot>> slots_;  // joining
  std::map<std::pair<int, void*>, std::shared_ptr<ExchangeSlot>> by_recv_;       // in flight
};

// Whether a start stages its exchange through host memory: JTBO_PEER_COPY_VIA_HOST=1.
inline bool ViaHostRequested() {
  const char* text = std::getenv("JTBO_PEER_COPY_VIA_HOST");
  return text != nullptr && std::string(text) == "1";
}

// The rank of `device` in `group` (device ordinals in group order), or -1.
inline int RankOf(int device, const int64_t* group, int64_t group_size) {
  for (int64_t rank = 0; rank < group_size; ++rank) {
    if (group[rank] == device) return static_cast<int>(rank);
  }
  return -1;
}

}  // namespace jtbo

#endif  // JTBO_FFI_PEER_EXCHANGE_H_
