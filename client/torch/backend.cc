#include "client/torch/backend.h"

#include <c10/util/Exception.h>

#include <cstring>

#include "client/torch/launch.h"

namespace collectived::client::torch_backend {

namespace {

constexpr const char* kIdKey = "collectived_unique_id";

collective_unique_id_t exchange_id(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                   collective_client_t* client, const std::string& socket) {
  collective_unique_id_t id{};
  if (rank == 0) {
    TORCH_CHECK(collective_get_unique_id(client, &id) == COLLECTIVE_OK,
                "collectived: making the group's unique id with the daemon at ", socket, ": ",
                collective_last_error());
    const auto* b = reinterpret_cast<const uint8_t*>(id.internal);
    store->set(kIdKey, std::vector<uint8_t>(b, b + sizeof id.internal));
  } else {
    // Blocks for the store's timeout (the group's), as every backend's
    // bootstrap does; torch names the key that never came.
    const std::vector<uint8_t> v = store->get(kIdKey);
    TORCH_CHECK(v.size() == sizeof id.internal, "collectived: the store's ", kIdKey, " has ",
                v.size(), " bytes, not ", sizeof id.internal,
                " (another program wrote it, or a different collectived_torch)");
    std::memcpy(id.internal, v.data(), v.size());
  }
  return id;
}

}  // namespace

Backend::Backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Config config)
    : c10d::Backend(rank, size),
      config_(std::move(config)),
      where_("collectived group " + (config_.group_name.empty() ? std::string("?") : config_.group_name) +
             " (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")") {
  node_ = node_connection(config_.socket);
  alloc_ = SharedHostAllocator::install(node_);
  const collective_unique_id_t id = exchange_id(store, rank, node_->get(), node_->socket());
  TORCH_CHECK(collective_comm_init_rank(node_->get(), &id, size, rank, &comm_) == COLLECTIVE_OK,
              "collectived: joining the group", config_.group_name.empty() ? "" : " ",
              config_.group_name, " as rank ", rank, " of ", size, " at ", node_->socket(),
              ": ", collective_last_error());
  setTimeout(config_.timeout);
  progress_ = std::make_unique<Progress>();
}

Backend::~Backend() {
  try {
    shutdown();
  } catch (...) {
    // A destructor reports nothing: shutdown() raises for a caller who asks.
  }
}

collective_comm_t* Backend::comm() const {
  TORCH_CHECK(comm_ != nullptr, "collectived: the process group ", config_.group_name,
              " was shut down or aborted; make a new one");
  return comm_;
}

const std::string& Backend::where() const { return where_; }

#if COLLECTIVED_TORCH_HAS_BACKEND_OPTIONS
c10::intrusive_ptr<c10d::Backend::Options> Backend::getBackendOptions() {
  auto o = c10::make_intrusive<c10d::Backend::Options>("collectived", config_.timeout);
  o->group_name = config_.group_name;
  return o;
}
#endif

void Backend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  config_.timeout = timeout;
}

#if COLLECTIVED_TORCH_HAS_ERROR_TYPE
c10d::ErrorType Backend::getError() {
  std::lock_guard lock(async_error_->mu);
  return async_error_->message.empty() ? c10d::ErrorType::SUCCESS : c10d::ErrorType::COMM_ERROR;
}
#endif

Backend::Started Backend::start(c10d::OpType type, const char* what, const at::Tensor& first,
                                std::chrono::milliseconds timeout) {
  {
    std::lock_guard lock(async_error_->mu);
    if (!async_error_->message.empty()) {
      throw c10::DistBackendError(
          c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)},
          async_error_->message + " (an earlier operation on CUDA tensors of " + where() +
              "; its output was undefined: make a new group)");
    }
  }
  const auto t = timeout == c10d::kUnsetTimeout ? config_.timeout : timeout;
  if (t != comm_timeout_) {
    TORCH_CHECK(collective_comm_set_timeout(comm(), t.count()) == COLLECTIVE_OK,
                "collectived: ", what, ": setting the operation's timeout: ",
                collective_last_error());
    comm_timeout_ = t;
  }
  Started s;
  if (coalescing_) {
    if (!coalesced_) {
      coalesced_ = std::make_unique<Launch>(*this, c10d::OpType::COALESCED, "coalesced operations",
                                            first);
    }
    s.launch = coalesced_.get();
  } else {
    s.owned = std::make_unique<Launch>(*this, type, what, first);
    s.launch = s.owned.get();
  }
  return s;
}

c10::intrusive_ptr<c10d::Work> Backend::finish(Started& op, std::vector<at::Tensor> outputs) {
  if (op.owned) return op.owned->submit(std::move(outputs));
  // Coalescing: this operation completes with endCoalescing's Work.
  auto w = c10::make_intrusive<Work>(getRank(), c10d::OpType::COALESCED, "coalesced operation",
                                     std::move(outputs), nullptr, config_.timeout);
  progress_->enqueue(w);
  return w;
}

void Backend::startCoalescing() {
  std::lock_guard lock(mu_);
  TORCH_CHECK(!coalescing_, "collectived: startCoalescing called twice on ", where());
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> Backend::endCoalescing() {
  std::lock_guard lock(mu_);
  TORCH_CHECK(coalescing_, "collectived: endCoalescing without startCoalescing on ", where());
  coalescing_ = false;
  std::unique_ptr<Launch> l = std::move(coalesced_);
  if (l && group_open_) {
    group_open_ = false;
    l->call(l->cuda() ? collective_group_end_stream(comm(), l->stream(), l->next())
                      : collective_group_end(comm(), l->next()));
  }
  if (!l) {
    // Nothing was submitted between the two.
    auto w = c10::make_intrusive<Work>(getRank(), c10d::OpType::COALESCED, "coalesced operations",
                                       std::vector<at::Tensor>{}, nullptr, config_.timeout);
    progress_->enqueue(w);
    return w;
  }
  return l->submit({});
}

void Backend::abort() {
  std::lock_guard lock(mu_);
  if (comm_ == nullptr) return;
  // Every rank's pending and later operations fail with `aborted` naming
  // this rank; ours complete through Progress with that error.
  collective_comm_abort(comm_);
  comm_ = nullptr;
  progress_->drain();
}

void Backend::shutdown() {
  std::lock_guard lock(mu_);
  if (comm_ == nullptr) return;
  progress_->drain();  // each Work settles within its operation's deadline
  // Leaving frees the communicator whatever the daemon answers: one that
  // another rank aborted, or whose daemon is gone, is left all the same
  // (destroy_process_group must not fail for them).
  collective_comm_destroy(comm_);
  comm_ = nullptr;
}

}  // namespace collectived::client::torch_backend
