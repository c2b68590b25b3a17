#include "daemon/comm_status.h"

namespace collectived::daemon {

void fill_comm_status(const std::vector<engine::CommSnapshot>& comms,
                      wire::StatusReply::Builder status) {
  auto out = status.initComms(static_cast<unsigned>(comms.size()));
  for (unsigned i = 0; i < comms.size(); ++i) {
    const engine::CommSnapshot& c = comms[i];
    auto o = out[i];
    o.setName(c.name.c_str());
    o.setNranks(c.nranks);
    o.setBroken(c.broken.c_str());
    auto ranks = o.initRanks(static_cast<unsigned>(c.ranks.size()));
    for (unsigned r = 0; r < c.ranks.size(); ++r) {
      const engine::RankSnapshot& rs = c.ranks[r];
      ranks[r].setRank(rs.rank);
      ranks[r].setPid(rs.pid);
      ranks[r].setSessionId(rs.session);
      ranks[r].setNode(rs.node.c_str());
      ranks[r].setActive(rs.active);
      ranks[r].setNextSeq(rs.next_seq);
      ranks[r].setRemote(rs.remote);
    }
    auto ops = o.initOperations(static_cast<unsigned>(c.ops.size()));
    for (unsigned k = 0; k < c.ops.size(); ++k) {
      const engine::OpSnapshot& op = c.ops[k];
      ops[k].setSeq(op.seq);
      ops[k].setOp(op.op.c_str());
      ops[k].setAgeMs(static_cast<std::uint64_t>(op.age.count()));
      ops[k].setStarted(op.started);
      ops[k].setRank(op.rank);
      auto missing = ops[k].initMissingRanks(static_cast<unsigned>(op.missing.size()));
      for (unsigned m = 0; m < op.missing.size(); ++m) missing.set(m, op.missing[m]);
    }
  }
}

}  // namespace collectived::daemon
