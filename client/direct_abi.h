// What libcollective's own kernels (client/direct_kernels.cu) take from the
// host side (client/direct.cc): one parameter block per launch. Plain C++17,
// read by nvcc and by g++.
//
// Every rank of a communicator whose ranks each own one GPU of one node owns
// a scratch allocation that every other rank has mapped (CUDA IPC, NVLink):
//
//   data:  2 slots x nranks sources x slot_bytes
//   flags: 2 slots x kMaxRanks sources x kMaxBlocks 64-bit words
//
// Operation `seq` uses slot seq % 2. Block b of rank r copies its part of
// what rank p needs into p's region (slot, source r), then stores
// phase_value(seq, 0) into p's flag (slot, r, b); it then waits until every
// peer p has stored that into its own flag (slot, p, b) and finishes its part
// from its own scratch. Two
// slots make reuse safe: a rank writes slot s for operation k + 2 only after
// it saw every peer's flags of operation k + 1, which each peer stores after
// its kernel of operation k has ended (one kernel at a time per rank, in
// order: client/direct.cc chains them).
//
// Two steps (all-reduce and broadcast of at least Args::two_step_bytes per
// rank; the host sets it from gpu.two_step_bytes where the communicator has
// gpu.two_step_min_gpus ranks or more, the same on every rank): the bytes are cut into nranks chunks, chunk q being
// rank q's. Step 1 moves chunk p to rank p (all-reduce: every rank pushes
// its input's chunk p; broadcast: the root pushes chunk p) and exchanges the
// flags with phase_value(seq, 0); rank q then reduces (all-reduce) its chunk
// and pushes it to every other rank (broadcast: to every other non-root
// rank), and the flags are exchanged again with phase_value(seq, 1). A rank's
// egress is 2 (n - 1) / n of the bytes where the one-step push sends n - 1
// times the bytes: 4 GPUs, 1.5 against 3. Every chunk sits at its own offset
// in a region (chunk q at q x chunk bytes), so the two steps never write the
// same bytes of a region.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define COLLECTIVED_HD __host__ __device__
#else
#define COLLECTIVED_HD
#endif

namespace collectived::client::direct {

inline constexpr int kMaxRanks = 8;
inline constexpr int kMaxBlocks = 128;
inline constexpr int kThreads = 512;
inline constexpr int kSlots = 2;

enum Kind : int { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2, kBroadcast = 3 };

struct Args {
  const void* send;
  void* recv;
  char* data[kMaxRanks];                 ///< rank p's scratch data, as mapped in this process
  unsigned long long* flags[kMaxRanks];  ///< rank p's flag words, as mapped in this process
  /// Host memory mapped for the device: the first wait that gives up stores
  /// (seq << 8) | (peer + 1) here (the peer that did not arrive).
  unsigned long long* error;
  unsigned long long seq;         ///< this operation's number on the communicator, from 1
  unsigned long long timeout_ns;  ///< how long a block waits for a peer (deadlines.operation_ms)
  unsigned long long count;       ///< elements of one rank's block
  unsigned long long slot_bytes;  ///< bytes of one (slot, source) region; a multiple of 256
  /// all-reduce and broadcast of this many bytes per rank or more take two
  /// steps (above); ~0 = never
  unsigned long long two_step_bytes;
  int kind;                       ///< Kind
  int dtype;                      ///< engine/gpu/kernels.h DType
  int redop;                      ///< engine/gpu/kernels.h RedOp
  int rank;
  int nranks;
  int root;
};

/// Whether an operation of `bytes` per rank takes two steps (above): the
/// second flag exchange costs a few microseconds, the one-step push n - 1
/// times the bytes over the sender's NVLink. A function of arguments that
/// are the same on every rank, so every rank decides the same.
COLLECTIVED_HD inline constexpr bool two_step(int kind, std::uint64_t bytes, std::uint64_t two_step_bytes) {
  return (kind == kAllReduce || kind == kBroadcast) && bytes >= two_step_bytes;
}

/// The value a block stores into its peers' flags in step `phase` (0 or 1)
/// of operation `seq`: it grows with every step of every operation, and a
/// wait for a value is passed by any later one.
COLLECTIVED_HD inline constexpr std::uint64_t phase_value(std::uint64_t seq, int phase) {
  return 2 * seq + static_cast<std::uint64_t>(phase);
}

/// Units of one two-step chunk: `total` units cut into `parts` chunks,
/// rounded up to a multiple of `align` units (so that chunks start on 256
/// bytes). The last chunks may be shorter, or empty.
COLLECTIVED_HD inline constexpr std::uint64_t chunk_units(std::uint64_t total, int parts,
                                                          std::uint64_t align) {
  const std::uint64_t per = (total + static_cast<std::uint64_t>(parts) - 1) / static_cast<std::uint64_t>(parts);
  return (per + align - 1) / align * align;
}

/// Index of flag (slot, source, block) in a rank's flag words.
COLLECTIVED_HD inline constexpr std::uint64_t flag_index(int slot, int source, int block) {
  return (static_cast<std::uint64_t>(slot) * kMaxRanks + static_cast<std::uint64_t>(source)) *
             kMaxBlocks + static_cast<std::uint64_t>(block);
}
inline constexpr std::uint64_t flag_words = static_cast<std::uint64_t>(kSlots) * kMaxRanks * kMaxBlocks;

/// Byte offset of region (slot, source) in a rank's scratch data.
COLLECTIVED_HD inline constexpr std::uint64_t region_offset(int slot, int source, int nranks,
                                             std::uint64_t slot_bytes) {
  return (static_cast<std::uint64_t>(slot) * static_cast<std::uint64_t>(nranks) +
          static_cast<std::uint64_t>(source)) * slot_bytes;
}

}  // namespace collectived::client::direct
