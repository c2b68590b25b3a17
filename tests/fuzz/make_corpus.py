#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/).

Messages are encoded from Cap'n Proto text by `capnp encode` (the capnproto
package), so the seeds follow ipc/protocol.capnp and ipc/peer.capnp as they
are. Run from anywhere: python3 tests/fuzz/make_corpus.py
"""
import os
import struct
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IPC = os.path.join(ROOT, "ipc")
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
MAGIC = 0x31464443


def encode(schema, root, text):
    return subprocess.run(
        ["capnp", "encode", "-I", "/usr/include", schema, root], cwd=IPC,
        input=text.encode(), check=True, capture_output=True).stdout


def frame(payload, nfds=0):
    return struct.pack("<IIII", MAGIC, len(payload), nfds, 0) + payload


def msg(text, nfds=0):
    return frame(encode("protocol.capnp", "Message", text), nfds)


def peer(text):
    return frame(encode("peer.capnp", "PeerMessage", text))


def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


HELLO = msg('(id = 1, hello = (protocolVersion = 1, clientName = "seed", libraryVersion = "0.1.0"))')
SECRET = 'secret = 0x"00112233445566778899aabbccddeeff"'
REG = lambda i, size=65536: msg(f"(id = {i}, registerHost = (size = {size}))", nfds=1)
F32, SUM = 8, 0


def coll(i, comm, kind, count, send=1, recv=2, root=0, dtype=F32, redop=SUM, soff=0, roff=0):
    return msg(f"(id = {i}, collective = (comm = {comm}, kind = {kind}, dtype = {dtype}, "
               f"redop = {redop}, count = {count}, root = {root}, "
               f"send = (handle = {send}, offset = {soff}), recv = (handle = {recv}, offset = {roff})))")


client_seeds = {
    "status": msg("(id = 2, status = ())"),
    "register_deregister": REG(2) + msg("(id = 3, deregister = (handle = 1))"),
    "register_too_big": REG(2, 1 << 20),
    "deregister_forged": msg("(id = 2, deregister = (handle = 12345))"),
    "comm_one_rank": REG(2) + REG(3)
    + msg(f'(id = 4, commInit = ({SECRET}, rendezvous = "self", nranks = 1, rank = 0))')
    + coll(5, 1, "allReduce", 1024)
    + coll(6, 1, "allGather", 256)
    + coll(7, 1, "reduceScatter", 256)
    + coll(8, 1, "broadcast", 512, root=0)
    + coll(9, 1, "reduce", 512, root=0)
    + coll(10, 1, "allToAll", 128)
    + coll(11, 1, "barrier", 0)
    + coll(12, 1, "allReduce", 16384, soff=8)
    + msg("(id = 13, p2pGroup = (comm = 1, items = [(isSend = true, peer = 0, buffer = (handle = 1, offset = 0), count = 64, dtype = 8), (isSend = false, peer = 0, buffer = (handle = 2, offset = 0), count = 64, dtype = 8)]))")
    + msg("(id = 14, commSplit = (comm = 1, color = 0, key = 0))")
    + coll(15, 2, "allReduce", 16)
    + msg("(id = 16, commDestroy = (comm = 2))")
    + msg("(id = 17, commAbort = (comm = 1))"),
    # Client deadlines (collective_comm_set_timeout), one past the daemon's cap.
    "comm_deadlines": REG(2) + REG(3)
    + msg(f'(id = 4, commInit = ({SECRET}, rendezvous = "self", nranks = 1, rank = 0))')
    + msg("(id = 5, collective = (comm = 1, kind = allReduce, dtype = 8, count = 64, "
          "send = (handle = 1, offset = 0), recv = (handle = 2, offset = 0), deadlineMs = 500))")
    + msg("(id = 6, collective = (comm = 1, kind = barrier, deadlineMs = 18446744073709551615))")
    + msg("(id = 7, p2pGroup = (comm = 1, deadlineMs = 1, items = [(isSend = true, peer = 0, buffer = (handle = 1, offset = 0), count = 8, dtype = 8), (isSend = false, peer = 0, buffer = (handle = 2, offset = 0), count = 8, dtype = 8)]))"),
    "comm_two_ranks_missing": msg(f'(id = 2, commInit = ({SECRET}, rendezvous = "self", nranks = 2, rank = 1))'),
    "collective_no_comm": coll(2, 77, "allReduce", 4),
    "peer_ping": msg('(id = 2, peerPing = (address = "127.0.0.1:1"))'),
    "attach_ring_wrong": msg("(id = 2, attachRing = (bytes = 4096))", nfds=2),
    "reply_types": msg("(id = 2, ok = void)") + msg("(id = 3, completed = (seq = 1))"),
}
for name, data in client_seeds.items():
    write("daemon_session_fuzz", name, b"\x00" + data)
    write("client_frame_fuzz", name, b"\x10" + HELLO + data)
write("daemon_session_fuzz", "no_hello", b"\x01" + msg("(id = 2, status = ())"))
write("client_frame_fuzz", "ring_slot", b"\x00" + coll(5, 1, "allReduce", 1024))

nonce = "0x\"" + "ab" * 32 + "\""
hello = peer(f'(hello = (protocolVersion = 2, nodeName = "seed", listenAddress = "127.0.0.1:47601", '
             f'streamIndex = 0, streams = 1, connectionId = 7, nonce = {nonce}, '
             f'dialedAddress = "127.0.0.1:47600", daemonVersion = "0.1.0"))')
challenge = peer(f'(challenge = (protocolVersion = 2, nodeName = "seed", listenAddress = "127.0.0.1:47600", '
                 f'nonce = {nonce}, daemonVersion = "0.1.0"))')
response = peer(f"(response = (proof = {nonce}))")
ready = peer(f"(ready = (proof = {nonce}))")
hb = peer("(heartbeat = (seq = 1, sentNs = 100, wallNs = 1700000000000000000))")
ack = peer("(heartbeatAck = (seq = 1, echoSentNs = 100, wallNs = 1700000000000000000))")
err = peer('(error = (code = permissionDenied, message = "wrong secret", nodeName = "seed"))')
# Protocol 2: a chunk's bytes follow its frame, unframed (DataChunk.raw).
data0 = peer('(data = (channel = 1, seq = 0, offset = 0, total = 8, raw = 8))') + bytes(range(1, 9))
data_split = (peer('(data = (channel = 2, seq = 0, offset = 4, total = 8, raw = 4))') + bytes([5, 6, 7, 8])
              + peer('(data = (channel = 2, seq = 0, offset = 0, total = 8, raw = 4))') + bytes([1, 2, 3, 4]))
data_bad = peer('(data = (channel = 3, seq = 5, offset = 18446744073709551615, total = 4, raw = 1))') + b"\x01"
data_overlap = (peer('(data = (channel = 4, seq = 0, offset = 0, total = 16, raw = 8))') + bytes(8)
                + peer('(data = (channel = 4, seq = 0, offset = 4, total = 16, raw = 8))') + bytes(8))
data_v1 = peer('(data = (channel = 1, seq = 0, offset = 0, total = 8, payload = 0x"0102030405060708"))')

write("peer_frame_fuzz", "acceptor_hello", b"\x00" + hello + response)
write("peer_frame_fuzz", "acceptor_error", b"\x00" + err)
write("peer_frame_fuzz", "initiator_challenge", b"\x01" + challenge + ready)
write("peer_frame_fuzz", "initiator_error", b"\x01" + err)
write("peer_frame_fuzz", "data_before_auth", b"\x00" + data0)
write("daemon_peer_fuzz", "hello_unauth", b"\x00" + hello + response)
write("daemon_peer_fuzz", "data_unauth", b"\x00" + data0)
write("daemon_peer_fuzz", "heartbeats", b"\x01" + hb + ack)
write("daemon_peer_fuzz", "data", b"\x01" + data0 + data_split + hb)
write("daemon_peer_fuzz", "data_bad_offset", b"\x01" + data_bad)
write("daemon_peer_fuzz", "data_overlap", b"\x01" + data_overlap)
write("daemon_peer_fuzz", "data_protocol1", b"\x01" + data_v1)
write("daemon_peer_fuzz", "error_after_auth", b"\x01" + err)
write("daemon_peer_fuzz", "hello_after_auth", b"\x01" + hello)

with open(os.path.join(ROOT, "systemd", "collectived.yaml"), "rb") as f:
    write("profile_fuzz", "shipped", f.read())
write("profile_fuzz", "small", b"client:\n  socket: /tmp/x.sock\n  allowed_uids: [0, 1000]\n"
      b"peer:\n  port: 47600\n  listen_address: 127.0.0.1\n  peers: [\"10.0.0.2:47600\", \"[fd00::2]:47600\"]\n"
      b"deadlines:\n  operation_ms: 1000\ntransports: [tcp, local]\nverbs:\n  hcas: [mlx5_0, \"mlx5_1:2\"]\n")
write("profile_fuzz", "override", b"log:\n  level: debug\n\n#--set\ntransports=[tcp,local]")
write("profile_fuzz", "bad_key", b"clinet:\n  socket: 3\n")
write("profile_fuzz", "anchors", b"a: &x {b: 1}\nc: *x\nclient: {socket_mode: \"0777\"}\n")
print("seeds written under", OUT)
