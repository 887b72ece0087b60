// The peer-copy all-to-all on XLA:CPU devices of one process: the same rendezvous as the
// GPU build, with the pushes done by memcpy inside the start call. It exists so that the
// protocol (matching, block offsets, buffer lifetimes, the staged mode's two phases) is
// tested on the CPU. A staged exchange copies through a heap buffer per device, freed by its
// device's wait: every peer's copies out of it are done once all have pushed.
#include <cstring>

#include "peer_exchange.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

jtbo::ExchangeRegistry& Registry() {
  static auto* registry = new jtbo::ExchangeRegistry();
  return *registry;
}

ffi::Error Start(ffi::RunId run, int32_t device, ffi::AnyBuffer send,
                 ffi::Result<ffi::AnyBuffer> recv, ffi::Span<const int64_t> group) {
  const int64_t group_size = static_cast<int64_t>(group.size());
  const int rank = jtbo::RankOf(device, group.begin(), group_size);
  if (rank < 0) {
    return ffi::Error::InvalidArgument("peer all-to-all: device " + std::to_string(device) +
                                       " is not in the exchange group");
  }
  const int64_t bytes = static_cast<int64_t>(send.size_bytes());
  char* staging = jtbo::ViaHostRequested() ? new char[bytes > 0 ? bytes : 1] : nullptr;
  std::string error;
  auto slot = Registry().Join(run.run_id, device, rank, static_cast<int>(group_size), bytes,
                              send.untyped_data(), recv->untyped_data(), nullptr, staging,
                              &error);
  if (!slot) {
    delete[] staging;
    return ffi::Error::Internal(error);
  }
  const int64_t block = bytes / group_size;
  if (staging != nullptr) {
    std::memcpy(staging, send.untyped_data(), bytes);
    if (!Registry().StageAndAwait(*slot, rank, nullptr, &error)) {
      return ffi::Error::Internal(error);
    }
    // Pull the blocks addressed to this device out of every peer's staging buffer.
    char* target = static_cast<char*>(recv->untyped_data());
    for (int64_t sender = 0; sender < group_size; ++sender) {
      std::memcpy(target + sender * block,
                  static_cast<const char*>(slot->staging[sender]) + rank * block, block);
    }
  } else {
    const char* source = static_cast<const char*>(send.untyped_data());
    for (int64_t peer = 0; peer < group_size; ++peer) {
      std::memcpy(static_cast<char*>(slot->recv[peer]) + rank * block, source + peer * block,
                  block);
    }
  }
  Registry().MarkPushed(*slot, rank, nullptr);
  return ffi::Error::Success();
}

ffi::Error Wait(int32_t device, ffi::AnyBuffer send, ffi::AnyBuffer recv,
                ffi::Result<ffi::AnyBuffer> done, ffi::Span<const int64_t> group) {
  (void)send;  // an operand only so that XLA keeps it alive until here
  std::string error;
  auto slot = Registry().AwaitPushes(device, recv.untyped_data(), &error);
  if (!slot) return ffi::Error::Internal(error);
  if (done->untyped_data() != recv.untyped_data()) {
    return ffi::Error::Internal("peer all-to-all wait: the result does not alias the buffer");
  }
  // Every rank has pushed, so every copy out of this device's staging buffer is done.
  const int rank = jtbo::RankOf(device, group.begin(), static_cast<int64_t>(group.size()));
  if (rank >= 0 && slot->staging[rank] != nullptr) {
    delete[] static_cast<char*>(slot->staging[rank]);
    slot->staging[rank] = nullptr;
  }
  Registry().Leave(device, recv.untyped_data(), *slot);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtboPeerAllToAllStart, Start,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtboPeerAllToAllWait, Wait,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("group"));
