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
  }
}
