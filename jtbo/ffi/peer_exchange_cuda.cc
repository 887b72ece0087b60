// The peer-copy all-to-all on the CUDA GPUs of one process: each device's blocks move to
// its peers by copy-engine transfers (cudaMemcpyPeerAsync) on a side stream, so the
// exchange takes no streaming multiprocessors and runs beside whatever the compute stream
// does between the start and the wait call.
//
// Start, on device d: record `ready_d` on the compute stream (d's send buffer is written and
// its receive buffer's memory is free), join the rendezvous, make the side streams wait for
// every device's `ready` (a peer's receive buffer may be written only once the peer has
// reached the exchange), push d's blocks (each cut over JTBO_PEER_COPY_STREAMS side streams),
// record `done_d` once all side streams are through. Wait, on
// device d: make the compute stream wait for every device's `done` (all blocks into d's
// buffer have landed, and d's send buffer has been read).
//
// Staged through host memory (JTBO_PEER_COPY_VIA_HOST=1): after `ready_d`, d's first side
// stream copies the whole send buffer into a pinned host staging buffer (device to host, one
// copy engine) and records `staged_d`; once every device has, d's upload stream copies the
// block addressed to d out of each peer's staging buffer into d's receive buffer (host to
// device, the other copy engine), each copy after that peer's `staged`, and records
// `done_d`. Staging buffers are pinned once and reused: d's buffer returns to d's pool at d's
// wait, which orders the compute stream after every device's `done` (all reads of it); a
// later start that takes it records its `ready` on the compute stream after that.
#include <cuda_runtime.h>

#include <array>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "peer_exchange.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

jtbo::ExchangeRegistry& Registry() {
  static auto* registry = new jtbo::ExchangeRegistry();
  return *registry;
}

ffi::Error CudaError(cudaError_t status, const char* what) {
  return ffi::Error::Internal(std::string("peer all-to-all: ") + what + ": " +
                              cudaGetErrorString(status));
}

#define JTBO_CUDA(call)                                      \
  do {                                                       \
    cudaError_t status_ = (call);                            \
    if (status_ != cudaSuccess) return CudaError(status_, #call); \
  } while (0)

// Restores the calling thread's current device on scope exit (XLA's thread is borrowed).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous_);
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  cudaError_t status_;
};

// A pinned host buffer of a staged exchange, and whether a start holds it.
struct StagingBuffer {
  void* data;
  int64_t bytes;
  bool in_use;
};

// Per device: the side streams, the upload stream of staged exchanges, peer access done, a
// pool of reusable events and every staging buffer pinned so far.
struct DeviceState {
  std::vector<cudaStream_t> sides;
  cudaStream_t upload = nullptr;
  std::vector<int> peers_enabled;
  std::vector<cudaEvent_t> free_events;
  std::vector<StagingBuffer> staging;
};

// Side streams per device (JTBO_PEER_COPY_STREAMS, 1 to 16, default 1). Each peer block is
// cut into that many chunks, one per stream, so that several copy engines can move it.
int CopyStreams() {
  static const int streams = [] {
    const char* text = std::getenv("JTBO_PEER_COPY_STREAMS");
    int value = text == nullptr ? 1 : std::atoi(text);
    return value < 1 ? 1 : (value > 16 ? 16 : value);
  }();
  return streams;
}

// One state per device ordinal, never moved: handlers of different devices hold references
// into it concurrently (a growing vector would reallocate under them).
constexpr int kMaxDevices = 64;
std::mutex state_mu;
std::array<DeviceState, kMaxDevices> states;

ffi::Error Prepare(int device, ffi::Span<const int64_t> group, DeviceState& state) {
  while (static_cast<int>(state.sides.size()) < CopyStreams()) {
    cudaStream_t side;
    JTBO_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    state.sides.push_back(side);
  }
  if (state.upload == nullptr) {
    JTBO_CUDA(cudaStreamCreateWithFlags(&state.upload, cudaStreamNonBlocking));
  }
  for (int64_t peer : group) {
    if (peer == device) continue;
    bool done = false;
    for (int enabled : state.peers_enabled) done |= enabled == peer;
    if (done) continue;
    int can_access = 0;
    JTBO_CUDA(cudaDeviceCanAccessPeer(&can_access, device, static_cast<int>(peer)));
    if (can_access) {
      cudaError_t status = cudaDeviceEnablePeerAccess(static_cast<int>(peer), 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // the one error that means what we wanted: clear it
      } else if (status != cudaSuccess) {
        return CudaError(status, "cudaDeviceEnablePeerAccess");
      }
    }
    state.peers_enabled.push_back(static_cast<int>(peer));
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<cudaEvent_t> TakeEvent(DeviceState& state) {
  {
    std::lock_guard<std::mutex> lock(state_mu);
    if (!state.free_events.empty()) {
      cudaEvent_t event = state.free_events.back();
      state.free_events.pop_back();
      return event;
    }
  }
  cudaEvent_t event;
  cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (status != cudaSuccess) return ffi::Unexpected(CudaError(status, "cudaEventCreate"));
  return event;
}

// A pinned host buffer of at least `bytes` from the device's pool, or a new one. Portable:
// every device's copies may read it.
ffi::ErrorOr<void*> TakeStaging(DeviceState& state, int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(state_mu);
    for (StagingBuffer& buffer : state.staging) {
      if (!buffer.in_use && buffer.bytes >= bytes) {
        buffer.in_use = true;
        return buffer.data;
      }
    }
  }
  const int64_t size = bytes > 0 ? bytes : 1;
  void* data = nullptr;
  cudaError_t status = cudaHostAlloc(&data, size, cudaHostAllocPortable);
  if (status != cudaSuccess) return ffi::Unexpected(CudaError(status, "cudaHostAlloc"));
  std::lock_guard<std::mutex> lock(state_mu);
  state.staging.push_back(StagingBuffer{data, size, true});
  return data;
}

void ReturnStaging(int device, void* data) {
  std::lock_guard<std::mutex> lock(state_mu);
  for (StagingBuffer& buffer : states[device].staging) {
    if (buffer.data == data) buffer.in_use = false;
  }
}

void ReturnEvent(int device, cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(state_mu);
  states[device].free_events.push_back(event);
}

// Gives a retired slot's events back to their devices' pools. Every record and every wait
// on them is enqueued by now, and CUDA resolves a wait when it is enqueued: reusing them is
// safe.
void ReturnEvents(const jtbo::ExchangeSlot& slot, ffi::Span<const int64_t> group) {
  std::lock_guard<std::mutex> lock(state_mu);
  for (size_t rank = 0; rank < slot.ready.size(); ++rank) {
    auto& pool = states[group[rank]].free_events;
    pool.push_back(static_cast<cudaEvent_t>(slot.ready[rank]));
    pool.push_back(static_cast<cudaEvent_t>(slot.done[rank]));
    if (slot.staged[rank] != nullptr) pool.push_back(static_cast<cudaEvent_t>(slot.staged[rank]));
  }
}

// The staged exchange's copies on device `device` (see the file comment), after the join.
ffi::Error StartStaged(int device, int rank, ffi::AnyBuffer send,
                       ffi::Result<ffi::AnyBuffer>& recv, cudaEvent_t ready, DeviceState& state,
                       jtbo::ExchangeSlot& slot) {
  const int64_t group_size = static_cast<int64_t>(slot.recv.size());
  const int64_t bytes = static_cast<int64_t>(send.size_bytes());
  cudaStream_t down = state.sides[0];
  JTBO_CUDA(cudaStreamWaitEvent(down, ready, 0));
  JTBO_CUDA(cudaMemcpyAsync(slot.staging[rank], send.untyped_data(), bytes,
                            cudaMemcpyDeviceToHost, down));
  auto staged = TakeEvent(state);
  if (staged.has_error()) return staged.error();
  JTBO_CUDA(cudaEventRecord(*staged, down));
  std::string message;
  if (!Registry().StageAndAwait(slot, rank, *staged, &message)) {
    return ffi::Error::Internal(message);
  }
  // The receive buffer is free after `ready`; each peer's block after that peer's `staged`.
  JTBO_CUDA(cudaStreamWaitEvent(state.upload, ready, 0));
  const int64_t block = bytes / group_size;
  char* target = static_cast<char*>(recv->untyped_data());
  for (int64_t step = 1; step <= group_size; ++step) {
    const int64_t sender = (rank + step) % group_size;
    JTBO_CUDA(cudaStreamWaitEvent(state.upload, static_cast<cudaEvent_t>(slot.staged[sender]), 0));
    JTBO_CUDA(cudaMemcpyAsync(target + sender * block,
                              static_cast<const char*>(slot.staging[sender]) + rank * block,
                              block, cudaMemcpyHostToDevice, state.upload));
  }
  auto done = TakeEvent(state);
  if (done.has_error()) return done.error();
  JTBO_CUDA(cudaEventRecord(*done, state.upload));
  Registry().MarkPushed(slot, rank, *done);
  return ffi::Error::Success();
}

ffi::Error Start(cudaStream_t stream, ffi::RunId run, int32_t device, ffi::AnyBuffer send,
                 ffi::Result<ffi::AnyBuffer> recv, ffi::Span<const int64_t> group) {
  const int64_t group_size = static_cast<int64_t>(group.size());
  const int rank = jtbo::RankOf(device, group.begin(), group_size);
  if (rank < 0) {
    return ffi::Error::InvalidArgument("peer all-to-all: device " + std::to_string(device) +
                                       " is not in the exchange group");
  }
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Error::InvalidArgument("peer all-to-all: device ordinal " +
                                       std::to_string(device) + " is out of range");
  }
  DeviceScope scope(device);
  JTBO_CUDA(scope.status());
  DeviceState& state = states[device];
  if (ffi::Error error = Prepare(device, group, state); error.failure()) return error;
  auto ready = TakeEvent(state);
  if (ready.has_error()) return ready.error();
  JTBO_CUDA(cudaEventRecord(*ready, stream));

  const int64_t bytes = static_cast<int64_t>(send.size_bytes());
  void* staging = nullptr;
  if (jtbo::ViaHostRequested()) {
    auto taken = TakeStaging(state, bytes);
    if (taken.has_error()) return taken.error();
    staging = *taken;
  }
  std::string message;
  auto slot = Registry().Join(run.run_id, device, rank, static_cast<int>(group_size), bytes,
                              send.untyped_data(), recv->untyped_data(), *ready, staging,
                              &message);
  if (!slot) {
    if (staging != nullptr) ReturnStaging(device, staging);
    return ffi::Error::Internal(message);
  }
  if (staging != nullptr) {
    return StartStaged(device, rank, send, recv, *ready, state, *slot);
  }
  for (cudaStream_t side : state.sides) {
    for (void* peer_ready : slot->ready) {
      JTBO_CUDA(cudaStreamWaitEvent(side, static_cast<cudaEvent_t>(peer_ready), 0));
    }
  }
  const int64_t block = bytes / group_size;
  const int64_t streams = static_cast<int64_t>(state.sides.size());
  const int64_t chunk = ((block + streams - 1) / streams + 255) / 256 * 256;
  const char* source = static_cast<const char*>(send.untyped_data());
  // Start with the next peer and end with this device, so that the devices do not all push
  // to the same peer at once.
  for (int64_t step = 1; step <= group_size; ++step) {
    const int64_t peer = (rank + step) % group_size;
    char* target = static_cast<char*>(slot->recv[peer]) + rank * block;
    for (int64_t s = 0, offset = 0; offset < block; ++s, offset += chunk) {
      const int64_t size = offset + chunk < block ? chunk : block - offset;
      JTBO_CUDA(cudaMemcpyPeerAsync(target + offset, static_cast<int>(group[peer]),
                                    source + peer * block + offset, device, size,
                                    state.sides[s]));
    }
  }
  // Join the other side streams into the first, whose event then marks every copy done.
  for (int64_t s = 1; s < streams; ++s) {
    auto part = TakeEvent(state);
    if (part.has_error()) return part.error();
    JTBO_CUDA(cudaEventRecord(*part, state.sides[s]));
    JTBO_CUDA(cudaStreamWaitEvent(state.sides[0], *part, 0));
    ReturnEvent(device, *part);  // the wait is enqueued: the event may be recorded again
  }
  auto done = TakeEvent(state);
  if (done.has_error()) return done.error();
  JTBO_CUDA(cudaEventRecord(*done, state.sides[0]));
  Registry().MarkPushed(*slot, rank, *done);
  return ffi::Error::Success();
}

ffi::Error Wait(cudaStream_t stream, int32_t device, ffi::AnyBuffer send, ffi::AnyBuffer recv,
                ffi::Result<ffi::AnyBuffer> result, ffi::Span<const int64_t> group) {
  (void)send;  // an operand only so that XLA keeps it alive until here
  if (result->untyped_data() != recv.untyped_data()) {
    return ffi::Error::Internal("peer all-to-all wait: the result does not alias the buffer");
  }
  std::string message;
  auto slot = Registry().AwaitPushes(device, recv.untyped_data(), &message);
  if (!slot) return ffi::Error::Internal(message);
  DeviceScope scope(device);
  JTBO_CUDA(scope.status());
  for (void* peer_done : slot->done) {
    JTBO_CUDA(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(peer_done), 0));
  }
  // After those waits on the compute stream, every read of this device's staging buffer is
  // ordered before anything a later start enqueues: it may serve the next staged exchange.
  const int rank = jtbo::RankOf(device, group.begin(), static_cast<int64_t>(group.size()));
  if (rank >= 0 && slot->staging[rank] != nullptr) ReturnStaging(device, slot->staging[rank]);
  if (Registry().Leave(device, recv.untyped_data(), *slot)) ReturnEvents(*slot, group);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtboPeerAllToAllStart, Start,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtboPeerAllToAllWait, Wait,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("group"));
