// A client session's GPU requests: registration of GPU allocations, the flag
// page its streams wait on, and the stream hand-off of GPU collectives.
#include "daemon/session.h"

namespace collectived::daemon {

namespace {
std::string data_text(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
}
}  // namespace

void ClientSession::handle_register_gpu(std::uint64_t id, wire::RegisterGpu::Reader req,
                                        std::vector<UniqueFd>& fds) {
  engine::gpu::GpuRegisterArgs a;
  switch (req.getKind()) {
    case wire::GpuMemoryKind::LEGACY_IPC: a.kind = engine::gpu::MemoryKind::legacy_ipc; break;
    case wire::GpuMemoryKind::POSIX_FD: a.kind = engine::gpu::MemoryKind::posix_fd; break;
    case wire::GpuMemoryKind::POOL_FD: a.kind = engine::gpu::MemoryKind::pool_fd; break;
    default: throw Error(Code::invalid_argument, "unknown GPU memory kind");
  }
  const std::size_t want = a.kind == engine::gpu::MemoryKind::legacy_ipc ? 0 : 1;
  if (fds.size() != want) {
    throw Error(Code::invalid_argument, "this GPU memory kind takes " + std::to_string(want) +
                                            " descriptors, got " + std::to_string(fds.size()));
  }
  if (want == 1) a.fd = std::move(fds[0]);
  a.handle = data_text(req.getHandle());
  a.size = req.getSize();
  a.device_uuid = data_text(req.getDeviceUuid());
  a.buffer_id = req.getBufferId();
  if (a.size == 0) throw Error(Code::invalid_argument, "GPU allocation of 0 bytes");
  auto memory = host_.gpu().open(id_, std::move(a));
  const std::uint64_t handle = host_.registry().add_device(id_, memory);
  host_.logger().debug("gpu_registered", {{"session", id_},
                                          {"handle", handle},
                                          {"bytes", memory->size()},
                                          {"device", memory->device()}});
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto r = m.initRegistered();
  r.setHandle(handle);
  r.setSize(memory->size());
  send(ipc::encode_frame(b));
}

void ClientSession::handle_attach_gpu(std::uint64_t id, wire::AttachGpu::Reader req,
                                      std::vector<UniqueFd>& fds) {
  if (fds.size() != 1) {
    throw Error(Code::invalid_argument,
                "AttachGpu expects one memfd descriptor, got " + std::to_string(fds.size()));
  }
  host_.gpu().attach_flags(id_, std::move(fds[0]), req.getBytes());
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.setOk();
  send(ipc::encode_frame(b));
}

std::shared_ptr<engine::gpu::RankSync> ClientSession::gpu_sync(wire::GpuSync::Reader req) {
  engine::gpu::GpuSyncArgs a;
  a.event_handle = data_text(req.getEventHandle());
  a.event_id = req.getEventId();
  a.flag_word = req.getFlagWord();
  a.ticket = req.getTicket();
  a.ready_word = req.getReadyWord();
  a.send_buffer_id = req.getSendBufferId();
  a.recv_buffer_id = req.getRecvBufferId();
  return host_.gpu().make_sync(id_, a);
}

}  // namespace collectived::daemon
