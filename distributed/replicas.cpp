// distributed/replicas.cpp — what data-parallel replicas share: shards, parameter broadcast and checks; see distributed/replicas.h.
#include "distributed/replicas.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/error.h"
#include "core/option_names.h"

namespace tally::distributed {

Shard shard(std::int64_t batch, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks)
    throw Error(fmt::format("shard: rank {} is not a rank of a world of {}", rank, ranks));
  if (batch < ranks)
    throw Error(fmt::format("a global batch of {} samples cannot be split over {} ranks (each needs at least one); "
                            "expected {} >= {}", batch, ranks, option_name(Option::batch_size), ranks));
  const std::int64_t begin = batch * rank / ranks, end = batch * (rank + 1) / ranks;
  return {begin, end - begin};
}

namespace {

// Floating-point tensors travel through the communicator (NCCL for CUDA ones); the rest (the
// int64 num_batches_tracked, always on the host) as host bytes.
void broadcast_tensor(Tensor t, Communicator& comm) {
  if (t.dtype() == DType::Float32 || t.dtype() == DType::Float64) return comm.broadcast(t, 0);
  if (!t.device().is_cpu() || !t.is_contiguous())
    throw Error(fmt::format("broadcast_parameters: cannot send {}", t.str()));
  comm.broadcast(t.raw_data(), t.nbytes(), 0);
}

std::vector<std::pair<std::string, Tensor>> state(const nn::Module& model) {
  auto all = model.named_parameters();
  for (auto& b : model.named_buffers()) all.push_back(std::move(b));
  return all;
}

// FNV-1a over every byte of the model's state, in order.
std::uint64_t state_hash(const nn::Module& model) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& [name, t] : state(model)) {
    const Tensor host = t.device().is_cpu() ? t.contiguous() : t.to(Device::cpu());
    const auto* p = static_cast<const unsigned char*>(host.raw_data());
    for (std::size_t i = 0; i < host.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

}  // namespace

void broadcast_parameters(nn::Module& model, Communicator& comm) {
  if (comm.size() == 1) return;
  for (auto& [name, t] : state(model)) broadcast_tensor(t, comm);
}

bool parameters_identical(const nn::Module& model, Communicator& comm) {
  if (comm.size() == 1) return true;
  const std::uint64_t mine = state_hash(model);
  std::uint64_t root = mine;
  comm.broadcast(&root, sizeof root, 0);
  double differing = root == mine ? 0.0 : 1.0;
  comm.all_reduce_sum(&differing, 1);
  return differing == 0.0;
}

namespace {

// `text` from `root` to every rank.
std::string broadcast_text(const std::string& text, Communicator& comm, int root) {
  std::uint64_t length = text.size();
  comm.broadcast(&length, sizeof length, root);
  std::string out = comm.rank() == root ? text : std::string(length, '\0');
  comm.broadcast(out.data(), out.size(), root);
  return out;
}

// The first line where `a` and `b` differ, as the pair of lines.
std::pair<std::string, std::string> first_difference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  std::string la, lb;
  for (;;) {
    const bool ga = static_cast<bool>(std::getline(sa, la)), gb = static_cast<bool>(std::getline(sb, lb));
    if (!ga && !gb) return {"", ""};
    if (!ga || !gb || la != lb) return {ga ? la : "(nothing)", gb ? lb : "(nothing)"};
  }
}

}  // namespace

void check_same_text(const std::string& text, Communicator& comm, const std::string& what) {
  if (comm.size() == 1) return;
  const std::string root = broadcast_text(text, comm, 0);
  // Which ranks differ, known to all; the first of them sends its text, so that every rank — the
  // one whose message reaches the user first included — names the same difference.
  std::vector<double> differs(static_cast<std::size_t>(comm.size()), 0.0);
  differs[static_cast<std::size_t>(comm.rank())] = root == text ? 0.0 : 1.0;
  comm.all_reduce_sum(differs.data(), differs.size());
  const auto first = std::find(differs.begin(), differs.end(), 1.0);
  if (first == differs.end()) return;
  const int r = static_cast<int>(first - differs.begin());
  const std::string other = broadcast_text(text, comm, r);
  const auto [a, b] = first_difference(root, other);
  throw Error(fmt::format("the ranks were started with different {}: rank 0 has '{}', rank {} has '{}' ({} of {} "
                          "ranks differ from rank 0); every rank must run the same command",
                          what, a, r, b, std::count(differs.begin(), differs.end(), 1.0), comm.size()));
}

void all_reduce_gradients(Communicator& comm, const std::vector<Tensor>& parameters, Tensor& loss,
                          std::size_t bucket_bytes, const std::function<void()>& reserve_states) {
  // What is summed: every gradient, flattened, then the step's loss.
  std::vector<Tensor> flat;
  std::int64_t n = 0;
  for (const Tensor& p : parameters) {
    flat.push_back(p.grad().view({-1}));
    n += flat.back().numel();
  }
  flat.push_back(loss.view({1}));
  n += 1;
  const DType dtype = loss.dtype();
  const auto per_bucket = static_cast<std::int64_t>(bucket_bytes / dtype_size(dtype));
  Tensor bucket = Tensor::empty({std::min(n, per_bucket)}, dtype, loss.device(), Category::temporary, "gradient_bucket");
  if (reserve_states) reserve_states();  // both buffers before the first collective
  // Fill a bucket, sum it over the ranks, copy the sums back.
  std::vector<std::pair<Tensor, std::int64_t>> pieces;  // (a piece of a flat tensor, its offset in the bucket)
  std::int64_t used = 0;
  auto flush = [&] {
    Tensor filled = bucket.narrow(0, 0, used);
    comm.all_reduce_sum(filled);
    for (auto& [piece, at] : pieces) piece.copy_(bucket.narrow(0, at, piece.numel()));
    pieces.clear();
    used = 0;
  };
  for (const Tensor& t : flat) {
    for (std::int64_t start = 0; start < t.numel();) {
      const std::int64_t len = std::min(t.numel() - start, bucket.numel() - used);
      Tensor piece = t.narrow(0, start, len);
      bucket.narrow(0, used, len).copy_(piece);
      pieces.emplace_back(piece, used);
      used += len;
      start += len;
      if (used == bucket.numel()) flush();
    }
  }
  if (used > 0) flush();
}

StateReduction::StateReduction(Communicator& comm, const std::vector<nn::StepState*>& states)
    : comm_(comm), states_(states) {
  for (nn::StepState* s : states_)
    for (Tensor& t : s->reducible()) {
      count_ += t.numel();
      tensors_.push_back(std::move(t));
    }
}

void StateReduction::reserve() {
  if (count_ > 0 && !buffer_.defined())
    buffer_ = Tensor::empty({count_}, DType::Float64, tensors_.front().device(), Category::temporary, "batch_norm_moments");
}

void StateReduction::run(std::int64_t local_batch, std::int64_t global_batch) {
  reserve();
  if (buffer_.defined()) {
    std::int64_t at = 0;
    for (const Tensor& t : tensors_) buffer_.narrow(0, at, t.numel()).copy_(t), at += t.numel();
    comm_.all_reduce_sum(buffer_);
    at = 0;
    for (Tensor& t : tensors_) t.copy_(buffer_.narrow(0, at, t.numel())), at += t.numel();
  }
  if (!skip_side_effects())
    for (nn::StepState* s : states_) s->scale_to_global(local_batch, global_batch);
}

}  // namespace tally::distributed
