// The host-side rules of the client kernels' protocol (direct_abi.h): every
// rank derives them alone, so they must be pure functions of what all ranks
// share.
#include "client/direct_abi.h"

#include <doctest/doctest.h>

using namespace collectived::client::direct;

TEST_CASE("phase values grow with every step of every operation") {
  for (std::uint64_t seq = 1; seq < 50; ++seq) {
    CHECK(phase_value(seq, 0) < phase_value(seq, 1));
    // An operation's last step is passed by the next one's first, so a wait
    // on a slot's previous value is passed by any later operation.
    CHECK(phase_value(seq, 1) < phase_value(seq + 1, 0));
  }
}

TEST_CASE("flag words: every (slot, source, block) has its own word inside the page") {
  const std::uint64_t last = flag_index(kSlots - 1, kMaxRanks - 1, kMaxBlocks - 1);
  CHECK(last == flag_words - 1);
  CHECK(flag_index(0, 0, 1) == 1);
  CHECK(flag_index(0, 1, 0) == static_cast<std::uint64_t>(kMaxBlocks));
  CHECK(flag_index(1, 0, 0) == static_cast<std::uint64_t>(kMaxRanks) * kMaxBlocks);
}
