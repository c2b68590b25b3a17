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
// what rank p needs into p's region (slot, source r), then stores seq into
// p's flag (slot, r, b); it then waits until every peer p has stored seq into
// its own flag (slot, p, b) and finishes its part from its own scratch. Two
// slots make reuse safe: a rank writes slot s for operation k + 2 only after
// it saw every peer's flags of operation k + 1, which each peer stores after
// its kernel of operation k has ended (one kernel at a time per rank, in
// order: client/direct.cc chains them).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define COLLECTIVED_HD __host__ __device__
#else
#define COLLECTIVED_HD
#endif

namespace collectived::client::direct {

inline constexpr int kMaxRanks = 8;
inline constexpr int kMaxBlocks = 64;
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
  int kind;                       ///< Kind
  int dtype;                      ///< engine/gpu/kernels.h DType
  int redop;                      ///< engine/gpu/kernels.h RedOp
  int rank;
  int nranks;
  int root;
};

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
