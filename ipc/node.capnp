# What the engines of two daemons say to each other about communicators that
# span their nodes. Carried as opaque payloads on the authenticated peer
# connections (ipc/peer.capnp, channel kEngineChannel); each payload is
#
#   [u32 header words][u32 0][NodeMessage as a flat array][raw bytes]
#
# so that bulk data (`data` messages) is copied once into the payload and
# never passes through Cap'n Proto. Fields are only ever added.

@0xd5c1a3e2b7f40918;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("collectived::nodewire");

struct NodeMessage {
  from @0 :Text;  # the sender's rendezvous address ("host:port")
  union {
    join @1 :Join;
    joinReply @2 :JoinReply;
    joinCancel @3 :JoinCancel;
    data @4 :OpData;
    broken @5 :Broken;
    slotFailed @6 :SlotFailed;
  }
}

# A rank on the sender's node joins the communicator whose rendezvous runs
# on the receiving daemon.
struct Join {
  id @0 :Data;           # the unique id's 16 random bytes
  rendezvous @1 :Text;   # the address the unique id names (the receiver)
  nranks @2 :UInt32;
  rank @3 :UInt32;
  pid @4 :Int32;
  node @5 :Text;         # the sender's node name
}

# The rendezvous daemon's answer to every node with ranks in the
# communicator: the rank map, or why the join failed (`code` != 0).
struct JoinReply {
  id @0 :Data;
  rendezvous @1 :Text;
  code @2 :UInt16;
  message @3 :Text;
  rank @4 :Int32;               # the rank an error concerns (-1: every rank)
  uid @5 :Text;                 # the communicator's name between daemons
  name @6 :Text;                # the short name logs and errors use
  nodeOfRank @7 :List(UInt32);  # rank -> index into nodes
  pidOfRank @8 :List(Int32);
  nodeAddresses @9 :List(Text);
  nodeNames @10 :List(Text);
}

# A rank that had sent `join` is gone (its client disconnected).
struct JoinCancel {
  id @0 :Data;
  rendezvous @1 :Text;
  rank @2 :UInt32;
  message @3 :Text;
}

# Data of one operation. Collectives: `seq`, `tag` and the sender's view of
# the operation and its plan (checked against the receiver's: a mismatch is
# named on both). Point-to-point (`p2p`): fromRank sends to toRank its index-th
# message.
struct OpData {
  uid @0 :Text;
  seq @1 :UInt64;
  tag @2 :UInt64;
  fromNode @3 :UInt32;
  kind @4 :UInt8;
  dtype @5 :UInt8;
  redop @6 :UInt8;
  count @7 :UInt64;
  root @8 :Int32;
  descRank @9 :UInt32;  # the sender's rank whose description this is
  p2p @10 :Bool;
  fromRank @11 :UInt32;
  toRank @12 :UInt32;
  index @13 :UInt64;
  # Collectives: the sender's plan (engine NodePlan: its algorithm, 1-based,
  # and its chunk), checked against the receiver's; 0: none (p2p).
  planAlgorithm @14 :UInt8;
  planChunk @15 :UInt64;
}

# The sender broke the communicator (a rank died, left or aborted; the
# daemon is stopping): every operation not yet done fails with `message`.
struct Broken {
  uid @0 :Text;
  code @1 :UInt16;
  message @2 :Text;
  floor @3 :UInt64;  # operations below this sequence number are not affected
                     # (a rank that left had finished them); 0: all are
}

# One operation failed on the sender (mismatch, invalid arguments, timeout).
struct SlotFailed {
  uid @0 :Text;
  seq @1 :UInt64;
  code @2 :UInt16;
  message @3 :Text;
}
