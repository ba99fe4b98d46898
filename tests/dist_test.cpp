// Data parallelism (distributed/ and mbp::Executor with a communicator). Run under `mpirun -np 2`
// (ctest does; each test skips, saying so, in a world of one):
//   * collectives: sums and broadcasts of host doubles and CPU tensors against values computed
//     on every rank;
//   * equivalence (float64, norm group and none): 3 SGD steps with momentum on 2 ranks equal one
//     process's full-batch steps to 1e-12, also with a different memory limit (so a different
//     micro-batch size) on each rank;
//     the ranks' parameters stay bit-identical;
//   * BatchNorm: running statistics are the global batch's — equal to one process running the
//     same split as micro-batches (every parameter and statistic to 1e-12), and the first
//     layer's equal to a plain full batch's;
//   * memory: predicted == measured peak on each rank, the gradient buckets counted; a small
//     bucket gives bit-identical results;
//   * option mismatches name the first differing line on every rank.
// CommandLine.* run without mpirun and start `mpirun -np 2 tally train` themselves.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/safetensors.h"
#include "distributed/communicator.h"
#include "distributed/replicas.h"
#include "distributed/staged.h"
#include "mbp/executor.h"
#include "nn/recompute.h"
#include "tests/command_line.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;

namespace {

std::shared_ptr<distributed::Communicator> world() { return distributed::process_world(); }

#define REQUIRE_TWO_RANKS()                                                                        \
  if (world()->size() != 2) GTEST_SKIP() << "needs exactly 2 ranks: run under mpirun -np 2 (this " \
                                            "world has " << world()->size() << ")"

class Dist : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

mbp::ExecutorOptions options(const Shape& sample, std::optional<std::int64_t> micro_batch,
                             std::shared_ptr<distributed::Communicator> comm) {
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = micro_batch;
  eo.communicator = std::move(comm);
  return eo;
}

}  // namespace

TEST_F(Dist, CollectivesSumAndBroadcastOverTheRanks) {
  REQUIRE_TWO_RANKS();
  auto& c = *world();
  EXPECT_EQ(c.backend(), "mpi");
  double host[3] = {1.0 + c.rank(), 0.25, -2.0 * c.rank()};
  c.all_reduce_sum(host, 3);
  EXPECT_EQ(host[0], 3.0);
  EXPECT_EQ(host[1], 0.5);
  EXPECT_EQ(host[2], -2.0);
  // Tensors: every rank draws both ranks' values, so it knows the sum.
  auto draw = [](int rank, std::size_t n) {
    std::mt19937 rng(17 + static_cast<unsigned>(rank));
    std::normal_distribution<double> d;
    std::vector<double> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  };
  const std::vector<double> mine = draw(c.rank(), 1000), r0 = draw(0, 1000), r1 = draw(1, 1000);
  Tensor t64 = Tensor::from_vector(mine, {10, 100});
  Tensor t32 = Tensor::from_vector(std::vector<float>(mine.begin(), mine.end()), {1000});
  c.all_reduce_sum(t64);
  c.all_reduce_sum(t32);
  const auto s64 = t64.to_vector<double>();
  const auto s32 = t32.to_vector<float>();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(s64[i], r0[i] + r1[i]) << i;
    EXPECT_EQ(s32[i], static_cast<float>(r0[i]) + static_cast<float>(r1[i])) << i;
  }
  Tensor b = Tensor::from_vector(mine, {1000});
  c.broadcast(b, 1);
  EXPECT_EQ(b.to_vector<double>(), r1);
  std::int64_t word = c.rank() == 0 ? 42 : -1;
  c.broadcast(&word, sizeof word, 0);
  EXPECT_EQ(word, 42);
  EXPECT_THROW(c.broadcast(b, 2), Error);
  Tensor ints = Tensor::from_vector(std::vector<std::int64_t>{1, 2}, {2});
  EXPECT_THROW(c.all_reduce_sum(ints), Error);
  // Texts of different lengths (rank 1's empty in the second round), every rank's to every rank:
  // how each rank's convolution engine record reaches the checkpoint rank 0 writes.
  const std::string texts[2] = {fmt::format("rank 0: {}", std::string(1000, 'a')), "rank 1 {\"passes\": {}}"};
  EXPECT_EQ(distributed::all_gather_text(c, texts[c.rank()]), std::vector<std::string>(texts, texts + 2));
  EXPECT_EQ(distributed::all_gather_text(c, c.rank() == 0 ? "x" : ""), (std::vector<std::string>{"x", ""}));
}

// The staged transport (distributed/staged.h: a device's tensors through host memory, for ranks that
// share a GPU), here with the CPU as its "device" — the same Tensor copies a GPU's take: a float32
// and a float64 tensor summed through a 1 KiB buffer, chunk by chunk, give the world's own sums bit
// for bit; a broadcast from rank 1; host buffers pass through; pipeline messages travel whole.
TEST_F(Dist, TheStagedTransportGivesTheWorldsCollectivesChunkByChunk) {
  REQUIRE_TWO_RANKS();
  const auto staged = distributed::make_staged(world(), Device::cpu(), 1024);
  EXPECT_EQ(staged->backend(), "mpi (staged)");
  EXPECT_TRUE(staged->serves(Device::cpu()));
  std::mt19937 rng(29 + static_cast<unsigned>(world()->rank()));
  std::normal_distribution<double> nd;
  std::vector<double> v(1000);
  for (auto& x : v) x = nd(rng);
  Tensor t32 = Tensor::from_vector(std::vector<float>(v.begin(), v.end()), {10, 100});
  Tensor t64 = Tensor::from_vector(std::vector<double>(v.begin(), v.begin() + 300), {300});
  Tensor w32 = t32.clone(Category::temporary), w64 = t64.clone(Category::temporary);
  staged->all_reduce_sum(t32);
  EXPECT_EQ(distributed::staged_chunks(*staged), 4u) << "4000 bytes through 1024";
  staged->all_reduce_sum(t64);
  EXPECT_EQ(distributed::staged_chunks(*staged), 7u) << "2400 bytes through 1024: three more";
  world()->all_reduce_sum(w32);
  world()->all_reduce_sum(w64);
  EXPECT_EQ(t32.to_vector<float>(), w32.to_vector<float>());
  EXPECT_EQ(t64.to_vector<double>(), w64.to_vector<double>());
  Tensor b = Tensor::from_vector(std::vector<double>(300, 1.0 + world()->rank()), {300});
  staged->broadcast(b, 1);
  EXPECT_EQ(b.to_vector<double>(), std::vector<double>(300, 2.0));
  double host = 1.0 + world()->rank();
  staged->all_reduce_sum(&host, 1);
  EXPECT_EQ(host, 3.0);
  EXPECT_THROW(distributed::make_staged(world(), Device::cpu(), 8), Error);
  // Pipeline messages: both ranks send before they receive (1F1B's steady state), whole messages
  // through the staging arena; a message larger than it is an Error naming the bytes.
  const int peer = 1 - world()->rank();
  const auto messages = distributed::make_staged(world(), Device::cpu(), 8192);
  Tensor out32 = Tensor::from_vector(std::vector<float>(v.begin(), v.begin() + 500), {5, 100});
  Tensor out64 = Tensor::from_vector(std::vector<double>(v.begin() + 500, v.begin() + 600), {100});
  const std::size_t a = messages->send(out32, peer), c = messages->send(out64, peer);
  Tensor in32 = Tensor::zeros({5, 100}, DType::Float32, Device::cpu(), Category::temporary, "in");
  Tensor in64 = Tensor::zeros({100}, DType::Float64, Device::cpu(), Category::temporary, "in");
  messages->recv(in32, peer);
  messages->recv(in64, peer);
  messages->wait_send(a);
  messages->wait_send(c);
  std::mt19937 peer_rng(29 + static_cast<unsigned>(peer));
  std::normal_distribution<double> peer_nd;  // the peer's draws, as it made them
  std::vector<double> pv(1000);
  for (auto& x : pv) x = peer_nd(peer_rng);
  EXPECT_EQ(in32.to_vector<float>(), std::vector<float>(pv.begin(), pv.begin() + 500));
  EXPECT_EQ(in64.to_vector<double>(), std::vector<double>(pv.begin() + 500, pv.begin() + 600));
  Tensor big = Tensor::zeros({4096}, DType::Float32, Device::cpu(), Category::temporary, "big");
  EXPECT_THROW((void)messages->send(big, peer), Error);
}

// A plan's probe of a pipeline stage on a GPU (the chooser's dry run of the step) sends and
// receives the stage's messages as tensors of the GPU that have no values: the staged transport
// lets none of them reach MPI, which takes host tensors only (it had passed them on, and the
// first plan of every GPU stage stopped at "expected a contiguous CPU tensor"). No GPU is needed:
// the dry run's tensors live on a virtual arena. A bad peer is still the host's error.
TEST_F(Dist, TheStagedTransportsDryRunMessagesOfADeviceStayOffMpi) {
  REQUIRE_TWO_RANKS();
  const Device gpu = Device::cuda(0);
  const auto staged = distributed::make_staged(world(), gpu, 1024);
  const int peer = 1 - world()->rank();
  const DryRun dry(gpu, std::size_t(1) << 20);
  Tensor out = Tensor::empty({64, 100}, DType::Float32, gpu, Category::temporary, "activation");
  Tensor in = Tensor::empty({64, 100}, DType::BFloat16, gpu, Category::temporary, "gradient");
  EXPECT_NO_THROW((void)staged->send(out, peer)) << "25,600 bytes in a dry run: larger than the buffer, sent by no one";
  EXPECT_NO_THROW(staged->recv(in, peer));
  EXPECT_THROW((void)staged->send(out, world()->rank()), Error);
  EXPECT_THROW(staged->recv(in, 2), Error);
  EXPECT_EQ(distributed::staging_high_water(*staged), 0u);
}

// Two ranks on one GPU (label gpu; tests/CMakeLists.txt's dist.gpu_two_ranks_one_gpu): NCCL refuses
// them, the staged transport carries their data parallelism. A float32 ResNet-20 (group norm) with
// the global batch of 20 split 10 + 10, micro-batches of 5, against one process's full batch on the
// same GPU: two SGD steps, the parameters within float32 rounding (1e-4), every peak predicted.
TEST_F(Dist, GpuTwoRanksShareOneGpuThroughHostMemory) {
  REQUIRE_TWO_RANKS();
  if (!cuda_available()) GTEST_SKIP() << "no GPU present: " << build_info();
  const Device gpu = Device::cuda(0);
  const auto comm = distributed::for_device(world(), gpu, distributed::Collectives::mpi);
  EXPECT_EQ(comm->backend(), "mpi (staged)");
  const std::int64_t B = 20;
  const Shape sample{3, 16, 16};
  const auto build = [&](const std::shared_ptr<Arena>& arena) {
    ArenaScope scope(arena);
    auto m = model("resnet20", "group", 3, DType::Float32);
    m->to(gpu);
    return m;
  };
  const auto ref_arena = std::make_shared<Arena>(gpu, std::size_t(256) << 20);
  const auto dp_arena = std::make_shared<Arena>(gpu, std::size_t(256) << 20);
  auto ref = build(ref_arena), dp = build(dp_arena);
  std::unique_ptr<optim::SGD> ref_opt, dp_opt;
  {
    ArenaScope scope(ref_arena);
    ref_opt = sgd(*ref);
  }
  {
    ArenaScope scope(dp_arena);
    dp_opt = sgd(*dp);
  }
  mbp::Executor ex(*dp, *dp_opt, dp_arena, options(sample, 5, comm));
  const distributed::Shard s = distributed::shard(B, comm->size(), comm->rank());
  const std::int64_t numel = shape_numel(sample);
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(B, sample, 300 + static_cast<std::uint32_t>(step));
    {
      ArenaScope scope(ref_arena);
      const Tensor x = input_tensor<float>(d, B, sample).to(gpu), y = Tensor::from_vector(d.labels, {B}).to(gpu);
      Tensor loss = cross_entropy((*ref)(x), y);
      loss.backward();
      NoGradGuard ng;
      ref_opt->step();
      ref_opt->zero_grad();
    }
    const mbp::StepResult r = ex.step(d.images.data() + s.offset * numel, d.labels.data() + s.offset, s.size);
    EXPECT_EQ(r.peak, r.predicted_peak) << "step " << step;
  }
  const auto a = values<float>(*ref), b = values<float>(*dp);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_LE(rel_error(b[i], a[i]), 1e-4) << "parameter " << i;
}

// Where a rank runs, from every rank's host name and GPU bus id: its machine's ranks and GPUs, and
// the ranks on its GPU — ranks that CUDA_VISIBLE_DEVICES gave one GPU each (all of them cuda:0 to
// themselves, different bus ids) do not share; one bus id on two machines is two GPUs.
TEST(Neighbours, RanksOfAMachineAndOfOneDeviceFromHostNamesAndBusIds) {
  using Ranks = std::vector<std::pair<std::string, std::string>>;
  const auto expect = [](const Ranks& ranks, int rank, distributed::Neighbours want, const char* what) {
    const distributed::Neighbours n = distributed::neighbours(ranks, rank);
    EXPECT_EQ(n.local_rank, want.local_rank) << what << ", rank " << rank;
    EXPECT_EQ(n.local_size, want.local_size) << what << ", rank " << rank;
    EXPECT_EQ(n.local_gpus, want.local_gpus) << what << ", rank " << rank;
    EXPECT_EQ(n.sharing_gpu, want.sharing_gpu) << what << ", rank " << rank;
  };
  const Ranks isolated{{"a", "0000:41:00.0"}, {"a", "0000:42:00.0"}, {"a", "0000:43:00.0"}, {"a", "0000:44:00.0"}};
  for (int r = 0; r < 4; ++r) expect(isolated, r, {r, 4, 4, 1}, "a GPU each");
  const Ranks two_on_each{{"a", "0000:41:00.0"}, {"a", "0000:42:00.0"}, {"a", "0000:41:00.0"}, {"a", "0000:42:00.0"}};
  for (int r = 0; r < 4; ++r) expect(two_on_each, r, {r, 4, 2, 2}, "4 ranks on 2 GPUs in turn");
  const Ranks two_machines{{"a", "0000:41:00.0"}, {"b", "0000:41:00.0"}, {"a", "0000:42:00.0"}, {"b", "0000:41:00.0"}};
  expect(two_machines, 0, {0, 2, 2, 1}, "machine a");
  expect(two_machines, 2, {1, 2, 2, 1}, "machine a");
  expect(two_machines, 1, {0, 2, 1, 2}, "machine b, one GPU");
  expect(two_machines, 3, {1, 2, 1, 2}, "machine b, one GPU");
  const Ranks cpu_and_gpu{{"a", ""}, {"a", ""}, {"a", "0000:41:00.0"}};
  expect(cpu_and_gpu, 0, {0, 3, 1, 1}, "a rank on the CPU shares no GPU");
  expect(cpu_and_gpu, 2, {2, 3, 1, 1}, "the one rank on a GPU");
  expect({{"a", ""}}, 0, {0, 1, 0, 1}, "a world of one");
  EXPECT_THROW(distributed::neighbours(isolated, 4), Error);
  EXPECT_THROW(distributed::neighbours(isolated, -1), Error);
}

// The same gathered from the ranks (one machine here): in world order, and a GPU each or one shared.
TEST_F(Dist, NeighboursAreGatheredFromEveryRank) {
  REQUIRE_TWO_RANKS();
  auto& c = *world();
  const distributed::Neighbours cpu = distributed::neighbours(c, "");
  EXPECT_EQ(cpu.local_rank, c.rank());
  EXPECT_EQ(cpu.local_size, 2);
  EXPECT_EQ(cpu.local_gpus, 0);
  EXPECT_EQ(cpu.sharing_gpu, 1);
  const distributed::Neighbours own = distributed::neighbours(c, fmt::format("0000:4{}:00.0", c.rank()));
  EXPECT_EQ(own.local_gpus, 2);
  EXPECT_EQ(own.sharing_gpu, 1);
  const distributed::Neighbours shared = distributed::neighbours(c, "0000:41:00.0");
  EXPECT_EQ(shared.local_gpus, 1);
  EXPECT_EQ(shared.sharing_gpu, 2);
}

TEST(Shard, EverySampleOnceSizesDifferByAtMostOne) {
  for (int ranks : {1, 2, 3, 7})
    for (std::int64_t batch : {7, 8, 100, 129}) {
      std::int64_t next = 0, lo = batch, hi = 0;
      for (int r = 0; r < ranks; ++r) {
        const distributed::Shard s = distributed::shard(batch, ranks, r);
        EXPECT_EQ(s.offset, next);
        next += s.size;
        lo = std::min(lo, s.size), hi = std::max(hi, s.size);
      }
      EXPECT_EQ(next, batch);
      EXPECT_LE(hi - lo, 1);
    }
  EXPECT_THROW(distributed::shard(3, 4, 0), Error);
  EXPECT_THROW(distributed::shard(8, 2, 2), Error);
}

// ---------------------------------------------------------------------------------------------
// 2 ranks against one process: the global batch of 20 split 10 + 10; each rank runs its 10 as
// micro-batches (m differs per rank when `uneven`), the reference the full 20 at once.
class TwoRanksEqualOneProcess : public Dist, public ::testing::WithParamInterface<std::tuple<std::string, bool>> {};

TEST_P(TwoRanksEqualOneProcess, ThreeSgdStepsWithMomentumFloat64) {
  REQUIRE_TWO_RANKS();
  const auto [norm, uneven] = GetParam();
  auto comm = world();
  const int rank = comm->rank();
  const std::int64_t B = 20;
  const Shape sample{3, 16, 16};
  auto ref = model("resnet20", norm, 3, DType::Float64);
  auto ref_opt = sgd(*ref);
  // Uneven: rank 1 runs in a 10 MiB budget, so its planner picks smaller micro-batches than rank
  // 0's, which has the default budget; even: both run micro-batches of 5.
  const auto budget = uneven && rank == 1 ? std::make_shared<Arena>(Device::cpu(), parse_size("10MiB"))
                                          : default_arena(Device::cpu());
  std::shared_ptr<nn::Module> dp;
  std::unique_ptr<optim::SGD> dp_opt;
  {
    ArenaScope in_budget(budget);
    dp = model("resnet20", norm, 3, DType::Float64);
    dp_opt = sgd(*dp);
  }
  mbp::Executor ex(*dp, *dp_opt, budget, options(sample, uneven ? std::nullopt : std::optional<std::int64_t>(5), comm));
  const distributed::Shard s = distributed::shard(B, comm->size(), rank);
  const std::int64_t numel = shape_numel(sample);
  double m_of[2] = {0, 0};
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(B, sample, 200 + static_cast<std::uint32_t>(step));
    const double ref_loss = full_batch_backward<double>(*ref, d, B, sample);
    {
      NoGradGuard ng;
      ref_opt->step();
      ref_opt->zero_grad();
    }
    const mbp::StepResult r = ex.step(d.images.data() + s.offset * numel, d.labels.data() + s.offset, s.size);
    if (!uneven) {
      EXPECT_EQ(r.micro_batch, 5);
    } else if (rank == 0) {
      EXPECT_EQ(r.micro_batch, 10) << "the default budget holds the whole share";
    } else {
      EXPECT_LT(r.micro_batch, 10) << "10 MiB holds fewer samples";
    }
    m_of[0] = m_of[1] = 0;
    m_of[rank] = static_cast<double>(r.micro_batch);
    comm->all_reduce_sum(m_of, 2);
    if (uneven) {
      EXPECT_NE(m_of[0], m_of[1]) << "the ranks run different micro-batch sizes";
    }
    EXPECT_NEAR(r.loss, ref_loss, 1e-12 * std::abs(ref_loss)) << "the global batch's loss on every rank";
    EXPECT_EQ(r.peak, r.predicted_peak);
  }
  const auto a = values<double>(*dp), b = values<double>(*ref);
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double e = rel_error(a[i], b[i]);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-12) << "parameter " << i;
  }
  const auto init = values<double>(*model("resnet20", norm, 3, DType::Float64));
  double moved = 0;
  for (std::size_t i = 0; i < a.size(); ++i) moved = std::max(moved, rel_error(a[i], init[i]));
  EXPECT_GT(moved, 1e-3) << "the parameters moved";
  EXPECT_TRUE(distributed::parameters_identical(*dp, *comm));
  if (rank == 0)
    std::cout << fmt::format("norm {}, micro-batches of {} | {}{}: worst per-tensor relative difference from one "
                             "process {}\n", norm, m_of[0], m_of[1], uneven ? " (rank 1 in 10 MiB)" : "", worst);
}

INSTANTIATE_TEST_SUITE_P(NormsAndSplits, TwoRanksEqualOneProcess,
                         ::testing::Combine(::testing::Values("group", "none"), ::testing::Bool()),
                         [](const auto& i) {
                           return std::get<0>(i.param) + (std::get<1>(i.param) ? "_uneven" : "_even");
                         });

// BatchNorm normalizes each micro-batch with its own statistics, so 2 ranks of 10 equal one
// process running micro-batches of 10 — every parameter and running statistic — and their running
// statistics come from the moments of all 20 samples.
TEST_F(Dist, BatchNormRunningStatisticsAreTheGlobalBatchs) {
  REQUIRE_TWO_RANKS();
  auto comm = world();
  const std::int64_t B = 20;
  const Shape sample{3, 16, 16};
  auto one = model("resnet20", "batch", 5, DType::Float64), dp = model("resnet20", "batch", 5, DType::Float64);
  auto full = model("resnet20", "batch", 5, DType::Float64);
  auto one_opt = sgd(*one), dp_opt = sgd(*dp), full_opt = sgd(*full);
  mbp::Executor one_ex(*one, *one_opt, options(sample, 10, nullptr));
  mbp::Executor dp_ex(*dp, *dp_opt, options(sample, std::nullopt, comm));
  const distributed::Shard s = distributed::shard(B, comm->size(), comm->rank());
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(B, sample, 300 + static_cast<std::uint32_t>(step));
    one_ex.step(d.images.data(), d.labels.data(), B);
    dp_ex.step(d.images.data() + s.offset * shape_numel(sample), d.labels.data() + s.offset, s.size);
    if (step == 0) {  // a plain full batch: the first BatchNorm sees the same 20 samples
      full_batch_backward<double>(*full, d, B, sample);
      NoGradGuard ng;
      full_opt->step();
    }
  }
  const auto a = values<double>(*dp, true), b = values<double>(*one, true);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 0u);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_LE(rel_error(a[i], b[i]), 1e-12) << "buffer " << i;
  const auto pa = values<double>(*dp), pb = values<double>(*one);
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_LE(rel_error(pa[i], pb[i]), 1e-12) << "parameter " << i;
  for (auto* bn : nn::batch_norm_layers(*dp)) EXPECT_EQ(bn->num_batches_tracked.to_vector<std::int64_t>()[0], 3);
  EXPECT_TRUE(distributed::parameters_identical(*dp, *comm));

  // After one step, the first layer's statistics against a plain full batch of 20.
  auto dp1 = model("resnet20", "batch", 5, DType::Float64);
  auto dp1_opt = sgd(*dp1);
  mbp::Executor dp1_ex(*dp1, *dp1_opt, options(sample, 3, comm));
  const Data d = make_data(B, sample, 300);
  dp1_ex.step(d.images.data() + s.offset * shape_numel(sample), d.labels.data() + s.offset, s.size);
  nn::BatchNorm2d* got = nn::batch_norm_layers(*dp1).front();
  nn::BatchNorm2d* want = nn::batch_norm_layers(*full).front();
  const auto gm = got->running_mean.to_vector<double>(), wm = want->running_mean.to_vector<double>();
  const auto gv = got->running_var.to_vector<double>(), wv = want->running_var.to_vector<double>();
  EXPECT_LE(rel_error(std::vector<double>(gm.begin(), gm.end()), std::vector<double>(wm.begin(), wm.end())), 1e-12);
  EXPECT_LE(rel_error(std::vector<double>(gv.begin(), gv.end()), std::vector<double>(wv.begin(), wv.end())), 1e-12);
}

// The collective buffers are arena memory the planner sees: exact peaks on a bounded arena, and
// a bucket of 64 KiB (many collectives) sums to the same bits as one of 8 MiB.
TEST_F(Dist, PeaksAreExactWithTheCollectiveBuffersAndBucketSizeChangesNoBit) {
  REQUIRE_TWO_RANKS();
  auto comm = world();
  const Shape sample{3, 16, 16};
  const std::int64_t B = 24;
  const distributed::Shard s = distributed::shard(B, comm->size(), comm->rank());
  std::vector<std::vector<std::vector<double>>> results;
  for (std::size_t bucket : {std::size_t(64) << 10, std::size_t(8) << 20}) {
    const auto budget = std::make_shared<Arena>(Device::cpu(), parse_size(comm->rank() == 0 ? "24MiB" : "16MiB"));
    std::shared_ptr<nn::Module> m;
    std::unique_ptr<optim::SGD> opt;
    {
      ArenaScope in_budget(budget);
      m = model("resnet20", "batch", 6);
      opt = sgd(*m);
    }
    mbp::ExecutorOptions eo = options(sample, std::nullopt, comm);
    eo.bucket_bytes = bucket;
    mbp::Executor ex(*m, *opt, budget, eo);
    for (int step = 0; step < 2; ++step) {
      const Data d = make_data(B, sample, 400 + static_cast<std::uint32_t>(step));
      const mbp::StepResult r =
          ex.step(d.images.data() + s.offset * shape_numel(sample), d.labels.data() + s.offset, s.size);
      EXPECT_EQ(r.peak, r.predicted_peak) << "bucket " << bucket << ", step " << step;
      EXPECT_LE(r.peak, budget->capacity());
    }
    EXPECT_GT(budget->stats()[Category::temporary].peak, static_cast<std::int64_t>(std::min<std::size_t>(bucket, 1 << 20)))
        << "the gradient bucket was allocated in the arena";
    EXPECT_TRUE(distributed::parameters_identical(*m, *comm));
    results.push_back(values<float>(*m));
  }
  EXPECT_TRUE(bitwise_equal(results[0], results[1]));
}

// Each rank with its own host tier (docs/host-tier.md): AdamW's state and update in host memory
// give the parameters of the all-device run, bit for bit, after the gradients' all-reduce; both
// arenas' peaks exact on every rank.
TEST_F(Dist, TheOptimizerOnEachRanksHostTierChangesNoBit) {
  REQUIRE_TWO_RANKS();
  auto comm = world();
  const Shape sample{3, 16, 16};
  const std::int64_t B = 24;
  const distributed::Shard s = distributed::shard(B, comm->size(), comm->rank());
  std::vector<std::vector<std::vector<double>>> results;
  for (const bool on_host : {false, true}) {
    const auto budget = std::make_shared<Arena>(Device::cpu(), parse_size("32MiB"));
    std::shared_ptr<nn::Module> m;
    std::unique_ptr<optim::AdamW> opt;
    {
      ArenaScope in_budget(budget);
      m = model("resnet20", "batch", 6);
      opt = std::make_unique<optim::AdamW>(m->parameters(), optim::AdamWOptions{.lr = 1e-3});
    }
    mbp::ExecutorOptions eo = options(sample, 5, comm);
    if (on_host) {
      eo.host_arena = Arena::make_host(parse_size("16MiB"));
      eo.placement = mbp::Placement::optimizer;
    }
    mbp::Executor ex(*m, *opt, budget, eo);
    for (int step = 0; step < 2; ++step) {
      const Data d = make_data(B, sample, 500 + static_cast<std::uint32_t>(step));
      const mbp::StepResult r =
          ex.step(d.images.data() + s.offset * shape_numel(sample), d.labels.data() + s.offset, s.size);
      EXPECT_EQ(r.peak, r.predicted_peak) << "step " << step;
      EXPECT_EQ(r.host_peak, r.host_predicted_peak) << "step " << step;
      if (on_host) {
        EXPECT_GT(r.host_peak, opt->state_bytes());
      }
    }
    EXPECT_TRUE(distributed::parameters_identical(*m, *comm));
    results.push_back(values<float>(*m));
    if (on_host) {  // the gradients' all-reduce sums device buffers: not with the gradients on the host
      eo.placement = mbp::Placement::gradients;
      try {
        mbp::Executor refused(*m, *opt, budget, eo);
        ADD_FAILURE() << "placement gradients was accepted with data parallelism";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("not available with data parallelism"), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_TRUE(bitwise_equal(results[0], results[1])) << "the host tier changed the parameters";
}

// Offloaded segments on every rank: the parameters of the run that keeps them, bit for bit; the
// cost model's choice is rank 0's rates on every rank, so the ranks plan alike.
TEST_F(Dist, OffloadedSegmentsOnEachRankChangeNoBitAndTheRanksChooseAlike) {
  REQUIRE_TWO_RANKS();
  auto comm = world();
  const Shape sample{3, 16, 16};
  const std::int64_t B = 24;
  const distributed::Shard s = distributed::shard(B, comm->size(), comm->rank());
  std::vector<std::vector<std::vector<double>>> results;
  for (const std::string policy : {"none", "offload", "auto"}) {
    const auto budget = std::make_shared<Arena>(Device::cpu(), parse_size("32MiB"));
    std::shared_ptr<nn::Module> m;
    std::unique_ptr<optim::AdamW> opt;
    {
      ArenaScope in_budget(budget);
      m = model("resnet20", "batch", 6);
      opt = std::make_unique<optim::AdamW>(m->parameters(), optim::AdamWOptions{.lr = 1e-3});
    }
    mbp::ExecutorOptions eo = options(sample, 5, comm);
    eo.recompute = policy;
    if (policy != "none") {
      eo.host_arena = Arena::make_host(parse_size("16MiB"));
      eo.placement = mbp::Placement::device;
    }
    mbp::Executor ex(*m, *opt, budget, eo);
    for (int step = 0; step < 2; ++step) {
      const Data d = make_data(B, sample, 700 + static_cast<std::uint32_t>(step));
      const mbp::StepResult r =
          ex.step(d.images.data() + s.offset * shape_numel(sample), d.labels.data() + s.offset, s.size);
      EXPECT_EQ(r.peak, r.predicted_peak) << policy << " step " << step;
      EXPECT_EQ(r.host_peak, r.host_predicted_peak) << policy << " step " << step;
      if (policy == "offload") {
        EXPECT_GT(r.host_peak, 0u);
      }
    }
    EXPECT_TRUE(distributed::parameters_identical(*m, *comm));
    results.push_back(values<float>(*m));
  }
  EXPECT_TRUE(bitwise_equal(results[0], results[1])) << "offloading changed the parameters";
  EXPECT_TRUE(bitwise_equal(results[0], results[2]));
  // With a budget no sample fits unless segments leave the device, auto takes the cost model's
  // choice; measured rates differ between ranks, so each takes rank 0's, and both choose alike.
  const auto tight = std::make_shared<Arena>(Device::cpu(), parse_size("22MiB"));
  std::shared_ptr<nn::Module> m;
  std::unique_ptr<optim::AdamW> opt;
  {
    ArenaScope in_budget(tight);
    m = model("resnet20", "batch", 6);
    opt = std::make_unique<optim::AdamW>(m->parameters(), optim::AdamWOptions{.lr = 1e-3});
  }
  const Shape big{3, 128, 128};
  mbp::ExecutorOptions eo = options(big, 1, comm);
  eo.micro_batch.reset();
  eo.recompute = "none";
  std::size_t need = 0;
  {
    mbp::Executor probe(*m, *opt, tight, eo);
    try {
      (void)probe.plan(8);
    } catch (const OutOfMemory& e) {
      need = e.requested();
    }
  }
  ASSERT_GT(need, 0u) << "one sample of 3x128x128 should not fit 22 MiB without recomputation";
  eo.recompute = "auto";
  eo.host_arena = Arena::make_host(parse_size("64MiB"));
  eo.placement = mbp::Placement::device;
  mbp::Executor ex(*m, *opt, tight, eo);
  (void)ex.plan(8);
  ASSERT_EQ(ex.recompute_choice().name, "per segment") << ex.recompute_choice().why;
  const double rates[2] = {ex.recompute_choice().rates->copy_bytes_per_second,
                           ex.recompute_choice().rates->flops_per_second};
  EXPECT_NO_THROW(distributed::check_same_text(fmt::format("{} {} {}", rates[0], rates[1], nn::recompute_state(*m).str()),
                                               *comm, "cost rates and choice"));
}

TEST_F(Dist, BroadcastParametersGivesEveryRankRank0sWeights) {
  REQUIRE_TWO_RANKS();
  auto comm = world();
  auto m = model("resnet20", "batch", 10 + static_cast<std::uint64_t>(comm->rank()));
  EXPECT_FALSE(distributed::parameters_identical(*m, *comm));
  distributed::broadcast_parameters(*m, *comm);
  EXPECT_TRUE(distributed::parameters_identical(*m, *comm));
  EXPECT_TRUE(bitwise_equal(values<float>(*m), values<float>(*model("resnet20", "batch", 10))));
}

TEST_F(Dist, DifferentOptionsNameTheFirstDifferenceOnEveryRank) {
  REQUIRE_TWO_RANKS();
  auto comm = world();
  EXPECT_NO_THROW(distributed::check_same_text("--lr 0.1\n--steps 3\n", *comm, "options"));
  try {
    distributed::check_same_text(fmt::format("--lr 0.{}\n--steps 3\n", comm->rank() + 1), *comm, "options");
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 has '--lr 0.1', rank 1 has '--lr 0.2'"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
#ifdef TALLY_MPIEXEC
// `mpirun -np 2 tally train` with a different memory limit per rank (so a different micro-batch
// on each) trains the weights `tally train` does alone, within float32 rounding.
TEST(CommandLine, TwoRanksWithTheirOwnMemoryLimitsTrainTheWeightsOfOneProcess) {
  if (distributed::launched_by_mpi()) GTEST_SKIP() << "starts mpirun itself";
  const auto dir = fresh_dir("tally_dist_cli");
  const std::string common = "train --norm group --steps 1 --batch-size 64 --no-progress --no-eval";
  ASSERT_EQ(run_command(fmt::format("{} {} --memory-limit 48MiB --save {}/one.safetensors > {}/one.log", TALLY_EXE,
                                    common, dir.string(), dir.string())), 0);
  ASSERT_EQ(run_command(fmt::format("{} {} {} --memory-limit 48MiB,24MiB --save {}/two.safetensors --out {}/two > "
                                    "{}/two.log",
                                    mpirun_two(TALLY_MPIEXEC, 240), TALLY_EXE, common, dir.string(), dir.string(),
                                    dir.string())), 0);
  const double worst = compare_state_dicts(dir / "one.safetensors", dir / "two.safetensors", 1e-5);
  std::cout << "worst per-tensor relative difference, 2 ranks vs 1 process: " << worst << "\n";
  std::ifstream f(dir / "two" / "summary.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j.at("world_size"), 2);
  ASSERT_EQ(j.at("ranks").size(), 2u);
  EXPECT_GT(j["ranks"][0]["micro_batch"].get<int>(), j["ranks"][1]["micro_batch"].get<int>())
      << "the rank with less memory runs smaller micro-batches";
  for (const auto& r : j["ranks"]) EXPECT_EQ(r["peak_bytes"], r["predicted_peak_bytes"]);
  std::ifstream log(dir / "two.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("parameters bit-identical on all 2 ranks"), std::string::npos) << text;
}
#endif
