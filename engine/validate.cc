#include "engine/validate.h"

#include "engine/gpu/executor.h"

#include <string>

namespace collectived::engine {

namespace {

/// Host operations take host buffers, GPU operations GPU buffers of the same
/// allocations the client registered (buffer ids: freed and reallocated
/// memory is refused).
void check_memory_kind(const CollectiveArgs& a, bool have_gpu, Part& part) {
  for (const auto* s : {&part.send, &part.recv}) {
    if (!s->reg) continue;
    const char* which = s == &part.send ? "send" : "recv";
    const bool on_device = s->reg->device != nullptr;
    if (!a.gpu && on_device) {
      throw Error(Code::invalid_argument,
                  std::string(which) + " buffer is GPU memory: use the stream-ordered call");
    }
    if (a.gpu && a.gpu->client_staged) {
      // The client's own host staging (its registration, checked like any
      // host buffer); the executor refuses it inside one node.
      if (on_device) {
        throw Error(Code::invalid_argument,
                    std::string(which) +
                        " buffer is GPU memory, but the operation is staged by the client");
      }
      continue;
    }
    if (a.gpu && !on_device) {
      throw Error(
          Code::invalid_argument,
          std::string(which) + " buffer is host memory, but the operation is on GPU buffers");
    }
    if (a.gpu) {
      const std::uint64_t now = s == &part.send ? a.gpu->send_buffer_id : a.gpu->recv_buffer_id;
      if (now != s->reg->device->buffer_id()) {
        throw Error(Code::invalid_argument,
                    std::string(which) + " buffer: " + stale_registration(*s->reg, now));
      }
    }
  }
  if (a.gpu && !have_gpu) {
    throw Error(Code::unavailable, "this daemon has no GPU executor");
  }
  part.gpu_sync = a.gpu;
}

/// Overlapping send and receive buffers are only allowed in the in-place
/// layout of each operation; anything else would read half-written data.
void check_overlap(const CollectiveArgs& a, int rank, std::uint64_t one, const Part& part) {
  if (!part.send.ptr || !part.recv.ptr || part.send.reg != part.recv.reg) return;
  const std::byte* s = part.send.ptr;
  const std::byte* r = part.recv.ptr;
  const bool overlap = s < r + part.recv.bytes && r < s + part.send.bytes;
  bool in_place = false;
  switch (a.kind) {
    case OpKind::all_gather:
      in_place = s == r + rank * one;
      break;
    case OpKind::reduce_scatter:
      in_place = r == s + rank * one;
      break;
    default:
      in_place = s == r;
      break;
  }
  if (overlap && !in_place) {
    throw Error(Code::invalid_argument,
                "send and recv buffers overlap but are not the in-place layout of " +
                    std::string(to_string(a.kind)));
  }
}

}  // namespace

Span resolve_span(Registry& registry, const ClientRef& client, const BufferArg& b,
                  std::uint64_t bytes, const char* which) {
  if (bytes == 0) return {};
  try {
    auto reg = registry.find_range(client.session, b.handle, b.offset, bytes);
    std::byte* p = reg->data() + b.offset;
    return Span{std::move(reg), p, bytes};
  } catch (const Error& e) {
    throw Error(e.code(), std::string(which) + " buffer: " + e.what());
  }
}

bool count_fits(std::uint64_t count, DType dtype, std::uint64_t n) {
  return count <= (std::uint64_t{1} << 46) / dtype_size(dtype) / n;
}

std::string stale_registration(const Registration& reg, std::uint64_t buffer_id_now) {
  return "stale registration " + std::to_string(reg.handle) + ": it was made for buffer id " +
         std::to_string(reg.device->buffer_id()) + ", but the memory there is now buffer id " +
         std::to_string(buffer_id_now) + " (freed and reallocated); register it again";
}

Desc validate_collective(Registry& registry, const ClientRef& client, const CollectiveArgs& a,
                         int nranks, int rank, bool have_gpu, Part& part) {
  Desc d;
  d.kind = a.kind;
  if (a.kind == OpKind::barrier || a.kind == OpKind::split) return d;
  const auto dtype = dtype_from_int(a.dtype);
  if (!dtype) throw Error(Code::invalid_argument, "unknown dtype " + std::to_string(a.dtype));
  d.dtype = *dtype;
  d.count = a.count;
  const bool reducing =
      a.kind == OpKind::all_reduce || a.kind == OpKind::reduce || a.kind == OpKind::reduce_scatter;
  if (reducing) {
    const auto op = redop_from_int(a.redop);
    if (!op) throw Error(Code::invalid_argument, "unknown reduction " + std::to_string(a.redop));
    d.redop = *op;
  }
  const bool rooted = a.kind == OpKind::broadcast || a.kind == OpKind::reduce;
  if (rooted) {
    if (a.root < 0 || a.root >= nranks) {
      throw Error(Code::invalid_argument, "root " + std::to_string(a.root) +
                                              " is not a rank of this communicator (0.." +
                                              std::to_string(nranks - 1) + ")");
    }
    d.root = a.root;
  }
  const std::uint64_t n = static_cast<std::uint64_t>(nranks);
  if (!count_fits(a.count, d.dtype, n)) {
    throw Error(Code::invalid_argument, "count " + std::to_string(a.count) + " is too large");
  }
  const std::uint64_t one = a.count * dtype_size(d.dtype);
  std::uint64_t send_bytes = one, recv_bytes = one;
  switch (a.kind) {
    case OpKind::all_gather:
      recv_bytes = one * n;
      break;
    case OpKind::reduce_scatter:
      send_bytes = one * n;
      break;
    case OpKind::all_to_all:
      send_bytes = recv_bytes = one * n;
      break;
    case OpKind::broadcast:
      if (rank != a.root) send_bytes = 0;
      break;
    case OpKind::reduce:
      if (rank != a.root) recv_bytes = 0;
      break;
    default:
      break;
  }
  part.send = resolve_span(registry, client, a.send, send_bytes, "send");
  part.recv = resolve_span(registry, client, a.recv, recv_bytes, "recv");
  check_memory_kind(a, have_gpu, part);
  d.gpu = a.gpu != nullptr;
  check_overlap(a, rank, one, part);
  return d;
}

P2PItem validate_p2p_item(Registry& registry, const ClientRef& client, const P2PArgs& a,
                          std::size_t i, int nranks, bool gpu) {
  P2PItem item;
  item.is_send = a.is_send;
  if (a.peer >= static_cast<std::uint32_t>(nranks)) {
    throw Error(Code::invalid_argument, "item " + std::to_string(i) + ": peer " +
                                            std::to_string(a.peer) + " is not a rank");
  }
  item.peer = static_cast<int>(a.peer);
  const auto dt = dtype_from_int(a.dtype);
  if (!dt) throw Error(Code::invalid_argument, "unknown dtype " + std::to_string(a.dtype));
  item.dtype = *dt;
  item.count = a.count;
  if (!count_fits(a.count, item.dtype)) throw Error(Code::invalid_argument, "count too large");
  const char* which = a.is_send ? "send" : "recv";
  item.span = resolve_span(registry, client, a.buffer, a.count * dtype_size(item.dtype), which);
  if (!gpu && item.span.reg && item.span.reg->device) {
    // The daemon's CPU copies host send/recv data: GPU memory there
    // would be a device address it cannot touch.
    throw Error(Code::invalid_argument,
                "item " + std::to_string(i) + ": " + which +
                    " buffer is GPU memory: end the group with collective_group_end_stream");
  }
  if (gpu && item.span.reg && !item.span.reg->device) {
    throw Error(Code::invalid_argument,
                "item " + std::to_string(i) + ": " + which +
                    " buffer is host memory, but the group is on GPU buffers (one group "
                    "takes one kind of memory)");
  }
  if (gpu && item.span.reg && a.buffer_id != 0 &&
      a.buffer_id != item.span.reg->device->buffer_id()) {
    throw Error(Code::invalid_argument, "item " + std::to_string(i) + ": " + which + " buffer: " +
                                            stale_registration(*item.span.reg, a.buffer_id));
  }
  return item;
}

}  // namespace collectived::engine
