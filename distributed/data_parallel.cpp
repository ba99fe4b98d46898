// distributed/data_parallel.cpp — shards, parameter broadcast and checks; see distributed/data_parallel.h.
#include "distributed/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace tally::distributed {

Shard shard(std::int64_t batch, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks)
    throw Error(fmt::format("shard: rank {} is not a rank of a world of {}", rank, ranks));
  if (batch < ranks)
    throw Error(fmt::format("a global batch of {} samples cannot be split over {} ranks (each needs at least one); "
                            "expected --batch-size >= {}", batch, ranks, ranks));
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

}  // namespace tally::distributed
