#include "ipc/stage_pieces.h"

#include <doctest/doctest.h>

namespace collectived::ipc {
namespace {

constexpr std::uint64_t KiB = 1024, MiB = 1024 * KiB;

TEST_CASE("staged bytes are cut in about eighths of at least 512 KiB, in whole 64 KiB") {
  CHECK(stage_piece_bytes(1) == kStagePieceMin);
  CHECK(stage_piece_bytes(512 * KiB) == 512 * KiB);
  CHECK(stage_piece_bytes(2 * MiB) == 512 * KiB);  // 4 pieces
  CHECK(stage_piece_bytes(4 * MiB) == 512 * KiB);  // 8 pieces
  CHECK(stage_piece_bytes(8 * MiB) == 1 * MiB);
  CHECK(stage_piece_bytes(8 * MiB + 1) == 1 * MiB);  // an eighth rounded down: 9 pieces
  CHECK(stage_piece_bytes(8 * MiB + 512 * KiB) == 1 * MiB + 64 * KiB);  // up to whole 64 KiB
  for (std::uint64_t total : {4 * MiB + 1, 16 * MiB - 3, 100 * MiB + 12345}) {
    CAPTURE(total);
    const std::uint64_t p = stage_piece_bytes(total);
    CHECK(p % kStagePieceAlign == 0);
    CHECK(stage_piece_count(total, p) <= 9);
    CHECK(stage_piece_count(total, p) * p >= total);
  }
}

TEST_CASE("a flag word reaches a value at or past it, across the wrap of 2^32") {
  CHECK(word_reached(5, 5));
  CHECK(word_reached(6, 5));
  CHECK_FALSE(word_reached(4, 5));
  CHECK(word_reached(2, 0xFFFFFFFEu));        // wrapped past it
  CHECK_FALSE(word_reached(0xFFFFFFFEu, 2));  // not yet wrapped to it
}

TEST_CASE("the piece count covers every byte, and an empty input is one piece") {
  CHECK(stage_piece_count(0, 512 * KiB) == 1);
  CHECK(stage_piece_count(1, 512 * KiB) == 1);
  CHECK(stage_piece_count(512 * KiB, 512 * KiB) == 1);
  CHECK(stage_piece_count(512 * KiB + 1, 512 * KiB) == 2);
  CHECK(stage_piece_count(2 * MiB, 512 * KiB) == 4);
  CHECK(stage_piece_count(5, 0) == 1);
}

TEST_CASE("the flag word's values of an operation's pieces end at its ticket, in order") {
  CHECK(stage_piece_value(100, 1, 0) == 100);
  CHECK(stage_piece_value(100, 4, 0) == 97);
  CHECK(stage_piece_value(100, 4, 3) == 100);
  // Across the word's wrap-around: still one apart, the last the ticket.
  CHECK(stage_piece_value(1, 4, 0) == 0xFFFFFFFEu);
  CHECK(static_cast<std::uint32_t>(stage_piece_value(1, 4, 1) - stage_piece_value(1, 4, 0)) == 1);
  CHECK(stage_piece_value(1, 4, 3) == 1);
}

}  // namespace
}  // namespace collectived::ipc
