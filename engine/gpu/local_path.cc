#include "engine/gpu/local_path.h"

#include <algorithm>
#include <string>

#include "engine/gpu/kernel_share.h"
#include "engine/gpu/rank_sync.h"

namespace collectived::engine::gpu {
LocalPath::LocalPath(ExecutorState& state, Completion& completion, const GpuOptions& options)
    : s_(state),
      completion_(completion),
      debug_sync_(options.debug_sync),
      one_shot_bytes_(options.one_shot_bytes),
      one_shot_env_(one_shot_bytes_ != 0),
      copy_engine_min_bytes_(options.copy_engine_min_bytes),
      two_step_min_gpus_(std::max(2, options.two_step_min_gpus)) {}

void LocalPath::run(GpuCollective op, std::function<void(Code, std::string)> done) {
  const int n = static_cast<int>(op.sync.size());
  std::vector<int> rank_dev(n, -1);
  for (int r = 0; r < n; ++r) {
    if (op.sync[r] && op.sync[r]->client_staged) {
      throw Error(Code::invalid_argument,
                  op.who[r] +
                      " staged its GPU buffers through host memory, but the communicator "
                      "has every rank on this node (only operations across nodes are staged)");
    }
  }
  for (int r = 0; r < n; ++r) {
    if (op.recv[r].reg)
      rank_dev[r] = op.recv[r].reg->device->device();
    else if (op.send[r].reg)
      rank_dev[r] = op.send[r].reg->device->device();
    if (!op.sync[r]) throw Error(Code::internal, "GPU operation without a stream hand-off");
  }
  // GPUs taking part, in rank order; the first is the lead.
  std::vector<int> devs;
  for (int d : rank_dev) {
    if (d >= 0 && std::find(devs.begin(), devs.end(), d) == devs.end()) devs.push_back(d);
  }
  if (devs.empty()) devs.push_back(s_.devices.front().ordinal);
  const std::uint64_t es = dtype_size(op.dtype);
  const std::uint64_t bytes = op.count * es;
  // One GPU doing everything wins up to ~8 MiB per rank for all-reduce,
  // broadcast and reduce (the split costs a cross-GPU event hop, ~15-20 us);
  // for the sharded operations the split (each GPU writing its own ranks'
  // chunks) wins above ~1 MiB per rank (docs/gpu.md, "Measurements").
  const bool sharded = op.kind == OpKind::all_gather || op.kind == OpKind::reduce_scatter ||
                       op.kind == OpKind::all_to_all;
  const std::uint64_t limit = one_shot_env_ ? one_shot_bytes_ : sharded ? (1u << 20) : (8u << 20);
  // A send/recv pair: one copy kernel on the sender's GPU (over NVLink).
  const bool one_shot = devs.size() == 1 || bytes <= limit || op.kind == OpKind::p2p;
  const std::size_t slot = std::hash<std::string>{}(op.comm) % kStreamsPerDevice;

  Pending p;
  p.done = std::move(done);
  p.deadline = op.deadline;
  p.who = op.who;
  for (auto& s : op.send)
    if (s.reg) p.spans.push_back(s);
  for (auto& s : op.recv)
    if (s.reg) p.spans.push_back(s);
  // Open every mapping in each executing GPU's context now: before anything
  // of this operation is enqueued, and outside the lock (opening a mapping
  // may wait for the GPU, which a deadline must still be able to unblock).
  for (int d : one_shot ? std::vector<int>{devs.front()} : devs) {
    for (const auto* v : {&op.send, &op.recv}) {
      for (const auto& sp : *v) {
        if (sp.reg && sp.reg->device) sp.reg->device->data_on(d);
      }
    }
  }
  std::lock_guard lock(s_.mu);
  const std::vector<int> exec = one_shot ? std::vector<int>{devs.front()} : devs;
  wait_for_inputs_locked(op, exec, slot, p);
  debug_sync(exec, slot, "waiting for the ranks' events");
  enqueue_shares_locked(op, rank_dev, exec, slot, p);
  debug_sync(exec, slot, "the kernels");
  join_locked(op, exec, slot, p);
}

void LocalPath::wait_for_inputs_locked(const GpuCollective& op, const std::vector<int>& exec,
                                       std::size_t slot, Pending& p) {
  const int n = static_cast<int>(op.sync.size());
  // 1. Every executing stream waits for every rank's producer work. The
  //    clients' events are opened in the first GPU's context, and only a
  //    stream of that GPU waits on them (the driver crashed, SIGSEGV in
  //    cuStreamWaitEvent, when a stream of another GPU waited on one); the
  //    other GPUs wait on a local event recorded behind those waits.
  const int front = s_.devices.front().ordinal;
  cudaSetDevice(front);
  for (int r = 0; r < n; ++r) {
    auto* s = static_cast<Sync*>(op.sync[r].get());
    if (s->event) {
      check_rt(cudaStreamWaitEvent(stream_of(front, slot), s->event->event, 0),
               "cudaStreamWaitEvent on rank " + std::to_string(r) + "'s event");
    } else {
      s_.cu->check(s_.cu->cuStreamWaitValue32(
                       reinterpret_cast<cu::Stream>(stream_of(front, slot)),
                       s->flags->device + 4 * static_cast<cu::DevicePtr>(s->ready_word), s->ticket,
                       cu::kStreamWaitValueGeq),
                   "cuStreamWaitValue32 on rank " + std::to_string(r) + "'s ready word");
    }
  }
  const bool gated = !(exec.size() == 1 && exec.front() == front);
  if (gated) {
    cudaEvent_t gate = take_event(p, front);
    check_rt(cudaEventRecord(gate, stream_of(front, slot)), "cudaEventRecord (gate)");
    for (int dev : exec) {
      if (dev == front) continue;
      cudaSetDevice(dev);
      check_rt(cudaStreamWaitEvent(stream_of(dev, slot), gate, 0), "cudaStreamWaitEvent (gate)");
    }
    if (std::find(exec.begin(), exec.end(), front) == exec.end()) {
      cudaSetDevice(front);
      cudaEvent_t tail = take_event(p, front);
      check_rt(cudaEventRecord(tail, stream_of(front, slot)), "cudaEventRecord");
      p.tails.emplace_back(front, tail);
    }
  }
}

void LocalPath::enqueue_shares_locked(const GpuCollective& op, const std::vector<int>& rank_dev,
                                      const std::vector<int>& exec, std::size_t slot, Pending& p) {
  // 2. The work, each executing GPU its share. A broadcast split over
  //    gpu.two_step_min_gpus GPUs or more takes two steps, every GPU
  //    waiting for the others in between (broadcast_step).
  const bool two_steps =
      op.kind == OpKind::broadcast && exec.size() >= static_cast<std::size_t>(two_step_min_gpus_);
  for (int step = 0; step < (two_steps ? 2 : 1); ++step) {
    if (step == 1) {
      std::vector<cudaEvent_t> first(exec.size());
      for (std::size_t i = 0; i < exec.size(); ++i) {
        cudaSetDevice(exec[i]);
        first[i] = take_event(p, exec[i]);
        check_rt(cudaEventRecord(first[i], stream_of(exec[i], slot)),
                 "cudaEventRecord (first step)");
      }
      for (std::size_t i = 0; i < exec.size(); ++i) {
        cudaSetDevice(exec[i]);
        for (std::size_t j = 0; j < exec.size(); ++j) {
          if (j != i) {
            check_rt(cudaStreamWaitEvent(stream_of(exec[i], slot), first[j], 0),
                     "cudaStreamWaitEvent (GPU " + std::to_string(exec[j]) + "'s first step)");
          }
        }
      }
    }
    for (std::size_t i = 0; i < exec.size(); ++i) {
      cudaSetDevice(exec[i]);
      KernelShare(op, rank_dev, exec, i, stream_of(exec[i], slot), two_steps ? step : -1,
                  s_.devices[exec[i]].sms, copy_engine_min_bytes_)
          .enqueue();
    }
  }
}

void LocalPath::join_locked(GpuCollective& op, const std::vector<int>& exec, std::size_t slot,
                            Pending& p) {
  const int n = static_cast<int>(op.sync.size());
  const int front = s_.devices.front().ordinal;
  // 3. Join on the lead, release every rank's stream, and let the other
  //    streams wait for the join (the next operation starts after this one).
  const int lead = exec.front();
  cudaSetDevice(lead);
  for (std::size_t i = 1; i < exec.size(); ++i) {
    cudaSetDevice(exec[i]);
    cudaEvent_t e = take_event(p, exec[i]);
    check_rt(cudaEventRecord(e, stream_of(exec[i], slot)), "cudaEventRecord");
    cudaSetDevice(lead);
    check_rt(cudaStreamWaitEvent(stream_of(lead, slot), e, 0), "cudaStreamWaitEvent");
  }
  for (int r = 0; r < n && !op.hold; ++r) {
    auto* s = static_cast<Sync*>(op.sync[r].get());
    const cu::DevicePtr word = s->flags->device + 4 * static_cast<cu::DevicePtr>(s->word);
    s_.cu->check(s_.cu->cuStreamWriteValue32(reinterpret_cast<cu::Stream>(stream_of(lead, slot)),
                                             word, s->ticket, cu::kStreamWriteValueDefault),
                 "cuStreamWriteValue32 (release rank " + std::to_string(r) + "'s stream)");
    s->released = true;
  }
  debug_sync(exec, slot, "the join and the flag writes");
  cudaEvent_t joined = take_event(p, lead);
  check_rt(cudaEventRecord(joined, stream_of(lead, slot)), "cudaEventRecord");
  p.tails.emplace_back(lead, joined);
  for (std::size_t i = 1; i < exec.size(); ++i) {
    cudaSetDevice(exec[i]);
    check_rt(cudaStreamWaitEvent(stream_of(exec[i], slot), joined, 0), "cudaStreamWaitEvent");
    cudaEvent_t tail = take_event(p, exec[i]);
    check_rt(cudaEventRecord(tail, stream_of(exec[i], slot)), "cudaEventRecord");
    p.tails.emplace_back(exec[i], tail);
  }
  p.syncs = std::move(op.sync);
  for (int d : exec) p.streams.emplace_back(d, stream_of(d, slot));
  if (std::find(exec.begin(), exec.end(), front) == exec.end())
    p.streams.emplace_back(front, stream_of(front, slot));
  p.comm = op.comm;
  completion_.queue_locked(std::move(p));
}

cudaEvent_t LocalPath::take_event(Pending& p, int dev) {
  cudaEvent_t e = s_.devices.take_event_locked(dev);
  p.events.emplace_back(dev, e);
  return e;
}

void LocalPath::debug_sync(const std::vector<int>& exec, std::size_t slot, const char* step) {
  if (!debug_sync_) return;
  for (int dev : exec) {
    cudaSetDevice(dev);
    const cudaError_t e = cudaStreamSynchronize(s_.devices[dev].streams[slot]);
    if (e != cudaSuccess) {
      s_.log.error("gpu_debug_sync",
                   {{"step", step}, {"device", dev}, {"error", cudaGetErrorString(e)}});
      check_rt(e, std::string("GPU ") + std::to_string(dev) + ": " + step);
    }
  }
  s_.log.info("gpu_debug_sync", {{"step", step}, {"ok", 1}});
}

}  // namespace collectived::engine::gpu
