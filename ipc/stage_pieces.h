// How a staged GPU operation across nodes is cut in pieces, and the flag-word
// value that marks each piece: the one rule of the daemon, which stages large
// operations itself, and of the client library, which stages the others and
// tells the daemon its pieces (GpuSync.readyPieces, outPieces).
#pragma once

#include <algorithm>
#include <cstdint>

namespace collectived::ipc {

/// Pieces are at least this large: a copy of less runs below the link's
/// speed, and each piece costs a copy call and a flag.
inline constexpr std::uint64_t kStagePieceMin = std::uint64_t{512} << 10;
inline constexpr std::uint64_t kStagePieceAlign = std::uint64_t{64} << 10;

/// Bytes per piece of `total` staged bytes: an eighth (rounded down, then up
/// to whole kStagePieceAlign: 8 or 9 pieces), at least kStagePieceMin (one
/// piece where `total` is no larger than the minimum).
constexpr std::uint64_t stage_piece_bytes(std::uint64_t total) {
  return std::max(kStagePieceMin,
                  (total / 8 + kStagePieceAlign - 1) / kStagePieceAlign * kStagePieceAlign);
}

/// How many pieces of `piece` bytes hold `total` staged bytes (at least one:
/// an empty input still has its ready mark).
constexpr std::uint32_t stage_piece_count(std::uint64_t total, std::uint64_t piece) {
  return piece == 0
             ? 1
             : static_cast<std::uint32_t>(std::max<std::uint64_t>(1, (total + piece - 1) / piece));
}

/// Whether a flag word holding `word` has reached `value`: the streams'
/// cuStreamWaitValue32 GEQ, read wrap-aware (tickets wrap around 2^32, and
/// a word is at most 2^31 ahead of what anyone waits for).
constexpr bool word_reached(std::uint32_t word, std::uint32_t value) {
  return static_cast<std::int32_t>(word - value) >= 0;
}

/// The value a flag word takes once the q-th of `pieces` pieces of an
/// operation holding `ticket` is done: the last piece's is the ticket (the
/// client takes `pieces` tickets of the word for it).
constexpr std::uint32_t stage_piece_value(std::uint32_t ticket, std::uint32_t pieces,
                                          std::uint32_t q) {
  return ticket - (pieces - 1) + q;
}

}  // namespace collectived::ipc
