// InPieces, the pieces of a staged operation's input as the host collective
// waits for them: what its poll() reads from the clients' ready words (the
// fiber's own reads, EngineChannel::wait_pieces in engine_channel.cc) against what the
// completion thread reports (arrived). No GPU: the words are host memory, as
// the clients' flag pages are.
#include "engine/gpu/executor.h"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "ipc/stage_pieces.h"

using collectived::Code;
using collectived::engine::gpu::InPieces;

namespace {

/// Two ranks' ready words and an InPieces of `pieces` pieces whose values
/// are the client rule's (stage_piece_value) for `ticket`.
struct Two {
  std::array<std::atomic<std::uint32_t>, 2> words;
  std::array<std::atomic<bool>, 2> forced{};
  InPieces in;
  std::uint32_t ticket;
  Two(std::uint32_t pieces, std::uint32_t t, std::uint32_t start) : ticket(t) {
    words[0] = start;
    words[1] = start;
    in.count = pieces;
    in.piece = 1;
    in.marks.resize(pieces);
    for (std::uint32_t q = 0; q < pieces; ++q) {
      for (int r = 0; r < 2; ++r) {
        in.marks[q].push_back(
            {&words[r], collectived::ipc::stage_piece_value(t, pieces, q), &forced[r]});
      }
    }
  }
  void write(int r, std::uint32_t q) {
    words[r].store(collectived::ipc::stage_piece_value(ticket, in.count, q));
  }
};

}  // namespace

TEST_CASE("InPieces::poll counts the pieces every rank's ready word shows, in order") {
  Two t(3, 1000, 997);  // the words hold the previous operation's ticket
  t.in.poll();
  CHECK(t.in.reached.load() == 0);
  t.write(0, 0);
  t.in.poll();
  CHECK(t.in.reached.load() == 0);  // rank 1's first piece is not in
  t.write(1, 0);
  t.in.poll();
  CHECK(t.in.reached.load() == 1);
  t.write(0, 2);  // a word moves past a value: every earlier piece is in too
  t.write(1, 1);
  t.in.poll();
  CHECK(t.in.reached.load() == 2);
  t.write(1, 2);
  t.in.poll();
  CHECK(t.in.reached.load() == 3);
}

TEST_CASE("InPieces::poll compares the words wrap-aware") {
  // The tickets wrap around 2^32: the last piece's value is past zero, the
  // first's below it.
  Two t(2, 1, 0xFFFFFFF0u);
  t.in.poll();
  CHECK(t.in.reached.load() == 0);  // 0xFFFFFFF0 is before 0 (the first piece's value)
  t.write(0, 0);
  t.write(1, 0);
  t.in.poll();
  CHECK(t.in.reached.load() == 1);
  t.write(0, 1);
  t.write(1, 1);
  t.in.poll();
  CHECK(t.in.reached.load() == 2);
}

TEST_CASE("InPieces::poll wakes nobody; the completion thread's later arrival changes nothing") {
  Two t(2, 50, 40);
  int wakes = 0;
  t.in.on_change([&] { ++wakes; });
  t.write(0, 1);
  t.write(1, 1);
  t.in.poll();
  CHECK(t.in.reached.load() == 2);
  CHECK(wakes == 0);              // the caller is the waiter
  t.in.arrived(0, Code::ok, "");  // the completion thread saw piece 0 since
  CHECK(t.in.reached.load() == 2);
  CHECK(wakes == 1);
  CHECK_FALSE(t.in.failed.load());
}

TEST_CASE("InPieces::poll does not take a word the daemon released for its input") {
  // A client that died, or a deadline that passed: the daemon writes the
  // ready word itself (release_ready), flag first. The input never came;
  // the completion thread reports the failure instead.
  Two t(1, 7, 6);
  t.write(0, 0);
  t.forced[1] = true;
  t.write(1, 0);
  t.in.poll();
  CHECK(t.in.reached.load() == 0);
  t.in.arrived(0, Code::aborted, "rank 1 disconnected");
  CHECK(t.in.failed.load());
  CHECK(t.in.reached.load() == 0);
}

TEST_CASE("InPieces without marks (the daemon's own copies) is left to the completion thread") {
  InPieces in;
  in.count = 2;
  in.poll();
  CHECK(in.reached.load() == 0);
  in.arrived(1, Code::ok, "");
  CHECK(in.reached.load() == 2);
  in.arrived(0, Code::timeout, "the deadline");
  CHECK(in.failed.load());
  CHECK(in.error().first == Code::timeout);
}
