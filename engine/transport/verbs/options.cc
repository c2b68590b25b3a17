#include "engine/transport/verbs/options.h"

#include <algorithm>

namespace collectived::engine::transport::verbs {

Options Options::from_profile(const config::Profile& p) {
  Options o;
  o.hcas = p.verbs.hcas;
  o.gid_index = p.verbs.gid_index;
  o.mtu = p.verbs.mtu;
  o.qps_per_connection = std::max<std::uint32_t>(1, p.verbs.qps_per_connection);
  o.retry_count = p.verbs.retry_count;
  o.timeout = p.verbs.timeout;
  o.pool_bytes = p.memory.host_pool_bytes;
  if (p.verbs.slot_bytes != 0) o.slot_bytes = p.verbs.slot_bytes;
  if (p.verbs.slots_per_peer != 0) o.slots_per_peer = p.verbs.slots_per_peer;
  o.mr_cache_entries = p.verbs.mr_cache_entries;
  o.in_place_min_bytes = p.verbs.in_place_min_bytes;
  return o;
}

}  // namespace collectived::engine::transport::verbs
