# The client <-> daemon control protocol of collectived.
#
# Serialization only (no capnp RPC): each frame on the Unix stream socket is a
# 16-byte header (ipc/frame.h) followed by one `Message` encoded as a flat
# array. Descriptors (memfds, CUDA VMM fds) travel beside a frame by SCM_RIGHTS;
# the header says how many belong to it.
#
# Every request carries an id chosen by the client; the reply and every
# asynchronous event about that request carry the same id.
#
# Compatibility: fields and union members are only ever added. A receiver that
# meets a union member it does not know answers `error` with code `protocol`.

@0x969a92295a369510;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("collectived::wire");

const protocolVersion :UInt32 = 1;

# Same values as collectived::Code (ipc/error.h) and collective_result_t.
enum Code {
  ok @0;
  invalidArgument @1;
  invalidUsage @2;
  system @3;
  remote @4;
  timeout @5;
  aborted @6;
  mismatch @7;
  notFound @8;
  permissionDenied @9;
  protocol @10;
  unavailable @11;
  internal @12;
  resourceExhausted @13;
}

# First message of every session, client -> daemon.
struct Hello {
  protocolVersion @0 :UInt32;
  clientName @1 :Text;       # free text for logs and status ("trainer rank 3")
  libraryVersion @2 :Text;   # libcollective's version string
}

struct HelloReply {
  protocolVersion @0 :UInt32;
  daemonVersion @1 :Text;
  nodeName @2 :Text;
  sessionId @3 :UInt64;
  maxFrameBytes @4 :UInt64;
  rendezvousAddress @5 :Text;     # "host:port" this daemon hosts rendezvous on (unique ids)
  operationDeadlineMs @6 :UInt64; # the node's deadlines, so clients wait a little longer
  rendezvousDeadlineMs @7 :UInt64;
}

struct ErrorReply {
  code @0 :Code;
  message @1 :Text;          # says what failed, who and where
}

# Registers host memory: one memfd travels with the frame. The memfd must be
# sealed against shrinking (F_SEAL_SHRINK), so that the daemon's mapping can
# never be truncated under it (which would SIGBUS the daemon).
struct RegisterHost {
  size @0 :UInt64;           # bytes to map, from offset 0 of the memfd
}

struct Registered {
  handle @0 :UInt64;
  size @1 :UInt64;
}

struct Deregister {
  handle @0 :UInt64;
}

struct StatusRequest {
  unused @0 :Void;
}

struct ClientInfo {
  sessionId @0 :UInt64;
  pid @1 :Int32;
  uid @2 :UInt32;
  gid @3 :UInt32;
  name @4 :Text;
  registrations @5 :UInt32;
  registeredBytes @6 :UInt64;
  connectedMs @7 :UInt64;
}

struct StatusReply {
  daemonVersion @0 :Text;
  protocolVersion @1 :UInt32;
  nodeName @2 :Text;
  pid @3 :Int32;
  uptimeMs @4 :UInt64;
  clients @5 :List(ClientInfo);
  registrations @6 :UInt32;
  registeredBytes @7 :UInt64;    # client memory mapped by the daemon
  poolBytes @8 :UInt64;          # daemon-owned pools
  residentBytes @9 :UInt64;      # the daemon's RSS
  openDescriptors @10 :UInt32;
  workerThreads @11 :UInt32;
  logLevel @12 :Text;
  communicators @13 :UInt32;
  operationsInFlight @14 :UInt32;
  operationsCompleted @15 :UInt64;
  peers @16 :List(PeerInfo);     # other nodes' daemons known since start
  peerAddress @17 :Text;         # "host:port" peers reach this daemon at ("" = no listener)
  gpu @18 :GpuStatus;
  comms @19 :List(CommStatus);   # communicators with ranks on this daemon, in-flight operations
  metricsAddress @20 :Text;      # where the Prometheus endpoint listens ("" = off)
  clientSocket @21 :Text;        # the socket clients connect to (client.socket)
  verbs @22 :VerbsStatus;        # the verbs transport on this node (issue D)
}

# One communicator in StatusReply.comms (collectivectl status, comms).
struct CommStatus {
  name @0 :Text;
  nranks @1 :UInt32;
  ranks @2 :List(CommRank);
  operations @3 :List(InFlightOp);
  broken @4 :Text;               # why it can run no more operations ("" = healthy)
}

struct CommRank {
  rank @0 :UInt32;
  pid @1 :Int32;
  sessionId @2 :UInt64;
  node @3 :Text;
  active @4 :Bool;               # false once it left, aborted or died
  nextSeq @5 :UInt64;            # sequence number of its next collective (this node's ranks)
  remote @6 :Bool;               # on another node: that node's daemon shows its operations
}

# An operation submitted and not yet answered: what a hang looks like.
struct InFlightOp {
  seq @0 :UInt64;
  op @1 :Text;                   # "all_reduce(count=1024, dtype=float32, op=sum)"
  ageMs @2 :UInt64;              # since its first rank submitted it
  started @3 :Bool;              # every rank arrived and it is running
  rank @4 :Int32;                # send/recv group: the rank that submitted it; -1: collective
  missingRanks @5 :List(UInt32); # this node's ranks that have not submitted it (group: unmatched peers)
}

# --- Communicators -----------------------------------------------------------

# Joins a communicator: every rank sends the same secret and rendezvous
# address (from the unique id) with its rank. Answered by CommReady once all
# ranks joined, or an error naming the ranks that did not arrive.
struct CommInit {
  secret @0 :Data;          # 16 random bytes from the unique id
  rendezvous @1 :Text;      # "host:port" of the daemon hosting the rendezvous
  nranks @2 :UInt32;
  rank @3 :UInt32;
}

struct CommReady {
  comm @0 :UInt64;          # this daemon's handle of the communicator; 0 = none (split NOCOLOR)
  rank @1 :UInt32;
  nranks @2 :UInt32;
  name @3 :Text;            # short printable id used in every message about it
  nodes @4 :UInt32;         # nodes its ranks live on (0 from an older daemon: unknown)
  node @5 :UInt32;          # this rank's node among them
  nextNodeFirstRank @6 :UInt32;  # the lowest rank of node (node + 1) % nodes
}

# Collective over `comm`: ranks with equal color form a new communicator.
struct CommSplit {
  comm @0 :UInt64;
  color @1 :Int32;
  key @2 :Int32;
}

# Leaves once this rank's earlier operations completed (answered Ok then).
struct CommDestroy {
  comm @0 :UInt64;
}

# Fails every pending and future operation of the communicator on all ranks.
struct CommAbort {
  comm @0 :UInt64;
}

# --- Operations ----------------------------------------------------------------

enum OpKind {
  allReduce @0;
  allGather @1;
  reduceScatter @2;
  broadcast @3;
  reduce @4;
  allToAll @5;
  barrier @6;
}

# A place in a registered buffer.
struct BufferRef {
  handle @0 :UInt64;
  offset @1 :UInt64;
}

# One collective. Counts follow NCCL (see client/collective.h). dtype and redop
# carry collective_dtype_t / collective_redop_t values. Answered by Completed
# or an error.
struct Collective {
  comm @0 :UInt64;
  kind @1 :OpKind;
  dtype @2 :UInt8;
  redop @3 :UInt8;
  count @4 :UInt64;
  root @5 :Int32;
  send @6 :BufferRef;
  recv @7 :BufferRef;
  gpu @8 :GpuSync;          # set: stream-ordered, on GPU buffers (see GPU section below)
  deadlineMs @9 :UInt64;    # 0: the node's deadlines.operation_ms; else this rank's own
                            # (collective_comm_set_timeout): the operation fails with timeout
                            # if not started this long after this submission
}

struct P2PItem {
  isSend @0 :Bool;
  peer @1 :UInt32;
  buffer @2 :BufferRef;
  count @3 :UInt64;
  dtype @4 :UInt8;
  bufferId @5 :UInt64;      # GPU groups: the allocation's buffer id now (stale check)
}

# Grouped sends and receives, completed together.
struct P2PGroup {
  comm @0 :UInt64;
  items @1 :List(P2PItem);
  gpu @2 :GpuSync;          # set: stream-ordered, on GPU buffers (collective_group_end_stream)
  deadlineMs @3 :UInt64;    # as Collective.deadlineMs
}

struct Completed {
  seq @0 :UInt64;           # the operation's sequence number in its communicator
}

# --- Shared-memory fast path ---------------------------------------------------

# Attaches a shared-memory ring pair for submissions and completions (layout in
# ipc/ring.h). Two descriptors travel with it: the memfd holding the rings, and
# an eventfd the client writes to wake the daemon's poller. Frames that fit a
# ring slot may then go through the rings instead of the socket; the socket
# stays for everything else.
struct AttachRing {
  bytes @0 :UInt64;         # size of the memfd
}

struct Message {
  id @0 :UInt64;
  union {
    hello @1 :Hello;
    helloReply @2 :HelloReply;
    error @3 :ErrorReply;
    ok @4 :Void;
    registerHost @5 :RegisterHost;
    registered @6 :Registered;
    deregister @7 :Deregister;
    status @8 :StatusRequest;
    statusReply @9 :StatusReply;
    commInit @10 :CommInit;
    commReady @11 :CommReady;
    commSplit @12 :CommSplit;
    commDestroy @13 :CommDestroy;
    commAbort @14 :CommAbort;
    collective @15 :Collective;
    p2pGroup @16 :P2PGroup;
    completed @17 :Completed;
    attachRing @18 :AttachRing;
    peerPing @19 :PeerPing;
    peerPong @20 :PeerPong;
    registerGpu @21 :RegisterGpu;
    attachGpu @22 :AttachGpu;
    attachedGpu @23 :AttachedGpu;
    directJoin @24 :DirectJoin;
    directJoined @25 :DirectJoined;
  }
}

# --- Peer daemons ----------------------------------------------------------------

enum PeerLinkState {
  connecting @0;
  ready @1;
  dead @2;
}

# One other node's daemon, in StatusReply.peers. Counters cover every
# connection to it since this daemon started.
struct PeerInfo {
  address @0 :Text;              # "host:port" of its peer listener
  node @1 :Text;                 # its node name ("" until a handshake told)
  state @2 :PeerLinkState;
  outbound @3 :Bool;             # the connection in use was opened by this daemon
  streams @4 :UInt32;            # TCP streams of the connection in use
  bytesSent @5 :UInt64;
  bytesReceived @6 :UInt64;
  rttUs @7 :UInt64;              # last heartbeat round trip (0: none yet)
  clockSkewMs @8 :Float64;       # its wall clock minus this node's
  errors @9 :UInt64;             # connections that failed or were refused
  connections @10 :UInt32;       # connections opened, either way, since start
  connectedSinceUnixMs @11 :Int64;  # when the connection in use became ready (0: none)
  connectedMs @12 :UInt64;       # for how long
  lastError @13 :Text;           # why the last connection failed
  transport @14 :Text;           # what carries engine traffic to it: "verbs", "tcp" ("" = none yet)
  transportReason @15 :Text;     # why that one (a fallback to tcp says why verbs did not work)
  verbs @16 :VerbsPeer;          # the verbs connection, when one was made or tried
  congestionControl @17 :Text;   # TCP congestion control of its streams (tcp.congestion_control)
}

# The verbs transport of this daemon (StatusReply.verbs).
struct VerbsStatus {
  enabled @0 :Bool;              # an HCA port is open and verbs is tried before tcp
  reason @1 :Text;               # why not, or what was opened
  device @2 :Text;               # "rxe0 port 1 (Ethernet, RoCE v2 gid 1 ..., mtu 1024, pool 64 MiB)"
  gpuDirect @3 :Text;            # the GPU memory path: "peer memory", "dma-buf" or "host staging"
  gpuDirectReason @4 :Text;
  poolBytes @5 :UInt64;          # the registered pool (memory.host_pool_bytes), registered once
  poolInUse @6 :UInt64;
  mrCacheEntries @7 :UInt64;     # client mappings registered now (verbs.mr_cache_entries at most)
  mrCacheHits @8 :UInt64;
  mrCacheMisses @9 :UInt64;      # registrations made
}

# One peer's verbs connection (PeerInfo.verbs).
struct VerbsPeer {
  healthy @0 :Bool;
  queuePairs @1 :Text;           # "rxe0:1 qpn 17 -> n1 qpn 18, mtu 1024, ..." (Pair::describe)
  pairs @2 :UInt32;              # connections built since start (1 + rebuilds)
  error @3 :Text;                # why the last one broke or could not be built
  bytesWritten @4 :UInt64;
  writes @5 :UInt64;
  creditStalls @6 :UInt64;
  inPlaceMessages @7 :UInt64;    # messages whose payload was written from the client's registered memory
  inPlaceBytes @8 :UInt64;       # payload bytes written that way (no copy into the pool)
  stagedBytes @9 :UInt64;        # bytes copied into the registered pool first (heads, scratch, small pieces)
  inPlaceError @10 :Text;        # why client memory could not be registered (then it is copied); "" if it could
  railBytes @11 :List(UInt64);   # bytes written on each rail (HCA k joined to the peer's HCA k)
}

# Asks the daemon to reach another node's daemon: opens the connection if
# needed (authenticated, deadlines.connect_ms) and measures one heartbeat
# round trip. Answered by PeerPong or an error naming the peer.
struct PeerPing {
  address @0 :Text;              # "host:port" of the peer's listener
}

struct PeerPong {
  node @0 :Text;
  rttUs @1 :UInt64;
  skewMs @2 :Float64;            # the peer's wall clock minus this node's
  newConnection @3 :Bool;        # the ping opened the connection
}

# --- GPU memory and stream-ordered collectives (issue C) -------------------------

# How the client exported a GPU allocation.
enum GpuMemoryKind {
  legacyIpc @0;   # cudaMalloc: cuIpcGetMemHandle of the allocation's base (no descriptor)
  posixFd @1;     # cuMemCreate (VMM): cuMemExportToShareableHandle; one fd travels with the frame
  poolFd @2;      # cudaMallocAsync from a pool made shareable (POSIX fd): the pool's fd
                  # travels with the frame, `handle` is cuMemPoolExportPointer's data
}

# Registers one whole GPU allocation (from its base). Answered by Registered;
# collectives then name places in it by handle and offset.
struct RegisterGpu {
  kind @0 :GpuMemoryKind;
  handle @1 :Data;          # 64 bytes (legacyIpc, poolFd); empty for posixFd
  size @2 :UInt64;          # bytes from the allocation's base
  deviceUuid @3 :Data;      # 16 bytes: the GPU (ordinals differ between processes)
  bufferId @4 :UInt64;      # CU_POINTER_ATTRIBUTE_BUFFER_ID in the client at registration
  # posixFd, a buffer spanning several cuMemCreate allocations mapped back to
  # back (PyTorch's expandable segments): one registration of them all, sent
  # in consecutive frames of at most 8 pieces, one fd each, in order (every
  # frame repeats the fields above; `size` is the whole and `bufferId` the
  # first piece's). The daemon maps them back to back into one range of its
  # own and answers Registered with handle 0 until the last piece is in.
  pieces @5 :List(GpuPiece);
  pieceCount @6 :UInt32;    # pieces of the whole registration (0: one allocation, one fd)
}

# One allocation of a registration of several (RegisterGpu.pieces).
struct GpuPiece {
  offset @0 :UInt64;        # from the registration's base: the pieces before it, together
  size @1 :UInt64;          # the allocation's bytes, mapped whole
}

# Attaches the client's flag page: a memfd (sealed against shrinking) of 32-bit
# words that the client's streams wait on (cuStreamWaitValue32, >=) and the
# daemon writes when an operation is done. One fd travels with it.
struct AttachGpu {
  bytes @0 :UInt64;
}

# The answer to AttachGpu: whether the client may run the collectives of a
# communicator whose ranks each own one GPU of this node with its own kernels
# on the caller's stream (client/direct.cc), and why (profile
# gpu.client_kernels and the MPS mode in force).
# One round of the exchange with which the ranks of a communicator set up the
# client's kernels (client/direct.h, daemon/direct_broker.h): answered with
# every rank's blob once every rank has joined the round, or declined (a rank
# on host memory, ranks on several nodes, a rank gone, the deadline). Not an
# operation of the communicator: it takes no sequence number.
struct DirectJoin {
  comm @0 :UInt64;
  round @1 :UInt32;         # 1, 2 or 3
  blob @2 :Data;            # at most 1 KiB
}

struct DirectJoined {
  blobs @0 :List(Data);     # every rank's, in rank order (empty when declined)
  declined @1 :Text;        # set: the communicator's GPU collectives go to the daemon, and why
}

struct AttachedGpu {
  clientKernels @0 :Bool;
  reason @1 :Text;
  maxBytes @2 :UInt64;      # gpu.client_kernel_max_bytes: largest rank buffer they take
  twoStepMinGpus @3 :UInt32; # gpu.two_step_min_gpus (0 from an older daemon: 3)
  twoStepBytes @4 :UInt64;   # gpu.two_step_bytes (0: never)
  clientStageMaxBytes @5 :UInt64;  # across nodes, rank buffers up to this many bytes (count x
                            # element size) the client stages itself (GpuSync.clientStaged);
                            # 0: never (gpu.client_stage_max_bytes, or an older daemon)
  ownSegmentOnGpu @6 :Bool; # this daemon takes GpuSync.ownSegmentOnGpu (its reduce-scatter
                            # between two nodes is pairwise); false from an older daemon
}

# The stream hand-off of one stream-ordered collective: the client recorded an
# interprocess event on its stream (the daemon's streams wait on it) and made
# its stream wait until flag word `flagWord` reaches `ticket` (the daemon
# writes it after the operation, or from the CPU if the operation fails).
struct GpuSync {
  eventHandle @0 :Data;     # 64 bytes, cuIpcGetEventHandle
  eventId @1 :UInt32;       # the client's pool index (the daemon opens each event once)
  flagWord @2 :UInt32;
  ticket @3 :UInt32;
  sendBufferId @4 :UInt64;  # the client's buffer ids now: a registration of memory since
  recvBufferId @5 :UInt64;  # freed and reallocated at the same address is refused
  readyWord @6 :UInt32;     # with no eventHandle: the client's stream wrote `ticket` to this
                            # word of its flag page when its producer work was done; the
                            # daemon's stream waits for it (and the daemon writes it itself if
                            # the client dies, so that its streams never wait forever)
  clientStaged @7 :Bool;    # across nodes: the client copied the input into host memory of
                            # its own (send/recv are host registrations) before its ready word,
                            # and copies the output back after its done word; the daemon runs
                            # the host collective on those buffers between the two words
  readyPieces @8 :UInt32;   # clientStaged: the input was copied in this many pieces (0: 1) of
  pieceBytes @9 :UInt64;    # pieceBytes; the stream wrote ticket - (readyPieces - 1) + q to
                            # readyWord once piece q was in
  pieceFirst @10 :UInt32;   # the pieces were copied from this one on, wrapping around
  outPieces @11 :UInt32;    # clientStaged: the stream copies the output back in this many
  outPieceBytes @12 :UInt64;  # pieces (0: 1) of outPieceBytes, piece q once the done word
                            # reaches ticket - (outPieces - 1) + q (the daemon may write those
                            # values as the pieces become final)
  ownSegmentOnGpu @13 :Bool; # clientStaged reduce-scatter over two nodes, one rank each (offered
                            # by AttachedGpu.ownSegmentOnGpu): the client did not stage its own
                            # segment of the input; the daemon writes the other node's
                            # contribution to it, undivided for avg, to the output, and the
                            # client's stream combines the two on the GPU
}

struct GpuStatus {
  available @0 :Bool;
  reason @1 :Text;          # why not, or the driver and GPU count
  devices @2 :List(Text);
  mps @3 :Text;             # managed | external | off (profile gpu.mps)
  mpsReason @4 :Text;       # the mode in force and why
  mappings @5 :UInt32;      # client GPU allocations open in the daemon
  mappedBytes @6 :UInt64;
}
