#include "engine/op.h"

namespace collectived::engine {

std::string_view to_string(OpKind kind) {
  switch (kind) {
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::all_gather: return "all_gather";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::broadcast: return "broadcast";
    case OpKind::reduce: return "reduce";
    case OpKind::all_to_all: return "all_to_all";
    case OpKind::barrier: return "barrier";
    case OpKind::split: return "comm_split";
    case OpKind::p2p: return "send/recv group";
  }
  return "operation";
}

}  // namespace collectived::engine
