// The far side (n1) of the RDMA tests: connects to the test process over TCP,
// opens its device, connects a verbs pair and echoes every message back
// (tag | kEchoBit), piece by piece, from its own registered buffers. Control
// commands come over the TCP channel: "error" (force the QPs into the error
// state), "rebuild", "exit".
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "engine/transport/verbs/ibverbs_library.h"
#include "engine/transport/verbs/device.h"
#include "ipc/error.h"
#include "tests/rdma/common.h"
#include "tests/rdma/socket_channel.h"

using namespace collectived;
namespace verbs = collectived::engine::transport::verbs;
using namespace collectived::rdma_test;
using namespace std::chrono_literals;

namespace {

void echo_loop(verbs::Device& device, verbs::Pair& pair, std::size_t slot_bytes,
               std::size_t buffers, const std::atomic<bool>& stop) {
  std::vector<verbs::Buffer> buf;
  std::vector<std::uint64_t> inflight(buffers, 0);
  for (std::size_t i = 0; i < buffers; ++i) buf.push_back(device.allocate(slot_bytes));
  std::size_t next = 0;
  while (!stop) {
    try {
      const verbs::Chunk c = pair.next_chunk(std::nullopt, verbs::Clock::now() + 200ms);
      const std::size_t i = next++ % buffers;
      if (inflight[i] != 0) {
        try {
          pair.wait_written(inflight[i], verbs::Clock::now() + 60s);
        } catch (const Error&) {
          // dropped by a rebuild: the buffer is free anyway
        }
        inflight[i] = 0;
      }
      std::memcpy(buf[i].data(), c.data.data(), c.data.size());
      pair.release(c);
      inflight[i] = pair.post_write(c.tag | kEchoBit, buf[i], 0, c.data.size(),
                                    verbs::MessagePart{c.offset, c.total});
    } catch (const Error& e) {
      if (e.code() == Code::timeout) continue;
      // Broken connection: wait for the test to order a rebuild.
      std::fill(inflight.begin(), inflight.end(), 0);
      std::this_thread::sleep_for(20ms);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  const std::string node = arg(a, "node", "n1");
  const std::string peer = arg(a, "peer", "n0");
  try {
    const verbs::Options options = options_from(a);
    auto lib = verbs::IbverbsLibrary::load();
    const auto deadline = verbs::Clock::now() + 60s;
    SocketChannel channel(connect_tcp(arg(a, "address", "10.99.0.1"), std::stoi(arg(a, "port", "0")), deadline),
                          peer);
    auto device = verbs::Device::open(lib, options, node,
                                      config::VerbsHca{arg(a, "device", env("RDMA_VM_DEV1", "rxe1")), 1});
    std::unique_ptr<verbs::Pair> pair = device->connect(channel, peer, deadline);
    std::fprintf(stderr, "verbs_peer %s: %s; %s\n", node.c_str(), device->describe().c_str(),
                 pair->describe().c_str());
    std::atomic<bool> stop{false};
    std::thread echo([&] { echo_loop(*device, *pair, options.slot_bytes, options.slots_per_peer, stop); });
    while (true) {
      const std::string cmd = channel.receive_text(verbs::Clock::now() + 3600s);
      if (cmd == "exit") break;
      if (cmd == "error") {
        pair->force_error();
        channel.send_text("ok");
      } else if (cmd == "rebuild") {
        pair->rebuild(channel, verbs::Clock::now() + 60s);
      } else {
        std::fprintf(stderr, "verbs_peer: unknown command '%s'\n", cmd.c_str());
      }
    }
    stop = true;
    echo.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "verbs_peer %s: %s\n", node.c_str(), e.what());
    return 1;
  }
}
