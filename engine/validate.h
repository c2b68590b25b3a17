// What a submission must satisfy before it takes part in matching: known
// dtype and reduction, root and peers among the ranks, counts that fit, and
// buffers that are the caller's registrations of the right kind of memory
// (host or GPU, not freed and reallocated since). Each check is written once,
// for collectives and send/recv groups alike. Throws Error; touches no
// engine state (the Registry is thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/comm.h"
#include "engine/registry.h"

namespace collectived::engine {

/// The registered range [b.offset, b.offset + bytes) of the client's buffer
/// `b`; empty for 0 bytes. Errors name `which` ("send", "recv").
Span resolve_span(Registry& registry, const ClientRef& client, const BufferArg& b,
                  std::uint64_t bytes, const char* which);

/// Whether `count` elements of `dtype`, `n` times, stay within the engine's
/// bound on one buffer (2^46 bytes).
bool count_fits(std::uint64_t count, DType dtype, std::uint64_t n = 1);

/// "stale registration H: it was made for buffer id X, but the memory there
/// is now buffer id Y (freed and reallocated); register it again".
std::string stale_registration(const Registration& reg, std::uint64_t buffer_id_now);

/// Validates one rank's collective and resolves its buffers into `part`
/// (with the GPU hand-off of a stream-ordered one). `have_gpu`: the engine
/// has a GPU executor.
Desc validate_collective(Registry& registry, const ClientRef& client, const CollectiveArgs& a,
                         int nranks, int rank, bool have_gpu, Part& part);

/// Validates item `i` of a send/recv group over `nranks` ranks; `gpu`: the
/// group is on GPU buffers.
P2PItem validate_p2p_item(Registry& registry, const ClientRef& client, const P2PArgs& a,
                          std::size_t i, int nranks, bool gpu);

}  // namespace collectived::engine
