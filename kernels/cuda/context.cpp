// kernels/cuda/context.cpp — per-device streams and handles, switches, checked-call errors,
// pinned memory, events and overlapped uploads (see context.h for the contract).
#include "kernels/cuda/context.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally::kernels::cuda {
namespace {

// ---- switches -------------------------------------------------------------------------------
std::atomic<bool> g_allow_tf32{false};
std::atomic<bool> g_deterministic{true};

// ---- per-device context ---------------------------------------------------------------------
constexpr int kMaxDevices = 64;

struct DeviceContext {
  cudaStream_t compute = nullptr;
  cudaStream_t copy = nullptr;
  cublasHandle_t cublas = nullptr;
#if TALLY_HAVE_CUDNN
  cudnnHandle_t cudnn = nullptr;
#endif
  double* slot_host = nullptr;  // mapped pinned memory for reduction results
  double* slot_device = nullptr;
};

// Contexts are created under the mutex and never destroyed (see context.h), so a pointer read
// once stays valid; each member is created once, under the mutex, on first use.
std::mutex g_mu;
std::array<std::atomic<DeviceContext*>, kMaxDevices> g_contexts{};

// "…/tally/kernels/cuda/conv.cu" -> "kernels/cuda/conv.cu": messages name files as the
// repository does.
const char* repo_path(const char* file) {
  for (const char* dir : {"/kernels/", "/core/", "/nn/", "/optim/", "/data/", "/distributed/", "/mbp/", "/apps/",
                          "/tests/", "/bench/"}) {
    const char* p = std::strstr(file, dir);
    if (p) return p + 1;
  }
  return file;
}

DeviceContext& context() {
  int dev = 0;
  TALLY_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices)
    throw Error(fmt::format("CUDA device {} is beyond the {} devices tally supports", dev, kMaxDevices));
  DeviceContext* ctx = g_contexts[static_cast<std::size_t>(dev)].load(std::memory_order_acquire);
  if (ctx) return *ctx;
  std::lock_guard<std::mutex> lock(g_mu);
  ctx = g_contexts[static_cast<std::size_t>(dev)].load(std::memory_order_relaxed);
  if (ctx) return *ctx;
  auto* c = new DeviceContext;  // never deleted: see context.h
  // Blocking compute stream: work on the legacy default stream stays ordered with it.
  TALLY_CUDA_CHECK(cudaStreamCreateWithFlags(&c->compute, cudaStreamDefault));
  // Non-blocking copy stream: uploads overlap whatever else runs.
  TALLY_CUDA_CHECK(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking));
  const detail::CublasLibrary& blas = detail::cublas_library();
  TALLY_CUBLAS_CHECK(blas.create(&c->cublas));
  // Set the stream once, here: cublasSetStream also resets the workspace to cuBLAS's own pool,
  // and gemm() sets an arena workspace before every call.
  TALLY_CUBLAS_CHECK(blas.set_stream(c->cublas, c->compute));
  TALLY_CUBLAS_CHECK(blas.set_math_mode(c->cublas, CUBLAS_DEFAULT_MATH));
  TALLY_CUBLAS_CHECK(blas.set_pointer_mode(c->cublas, CUBLAS_POINTER_MODE_HOST));
  void* slot = nullptr;
  TALLY_CUDA_CHECK(cudaHostAlloc(&slot, 64, cudaHostAllocMapped));
  c->slot_host = static_cast<double*>(slot);
  void* dslot = nullptr;
  TALLY_CUDA_CHECK(cudaHostGetDevicePointer(&dslot, slot, 0));
  c->slot_device = static_cast<double*>(dslot);
  g_contexts[static_cast<std::size_t>(dev)].store(c, std::memory_order_release);
  return *c;
}

}  // namespace

// ---- errors -----------------------------------------------------------------------------------
namespace detail {

void throw_cuda(cudaError_t status, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so that the next call starts clean
  throw Error(fmt::format("{} failed at {}:{}: {} ({})", call, repo_path(file), line, cudaGetErrorName(status),
                          cudaGetErrorString(status)));
}

void throw_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  const CublasLibrary& blas = cublas_library();  // loaded: the call that failed came from it
  throw Error(fmt::format("{} failed at {}:{}: {} ({})", call, repo_path(file), line, blas.get_status_name(status),
                          blas.get_status_string(status)));
}

#if TALLY_HAVE_CUDNN
void throw_cudnn(cudnnStatus_t status, const char* call, const char* file, int line) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  throw Error(fmt::format("{} failed at {}:{}: {}{}{}", call, repo_path(file), line, cudnnGetErrorString(status),
                          detail[0] ? ": " : "", detail));
}
#endif

void fail(const std::string& message) { throw Error(message); }

void check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Error(fmt::format("launch of kernel {} failed at {}:{}: {} ({})", kernel, repo_path(file), line,
                            cudaGetErrorName(e), cudaGetErrorString(e)));
}

cudaStream_t stream() { return context().compute; }
cublasHandle_t cublas() { return context().cublas; }

#if TALLY_HAVE_CUDNN
cudnnHandle_t cudnn() {
  DeviceContext& c = context();
  std::lock_guard<std::mutex> lock(g_mu);
  if (!c.cudnn) {
    TALLY_CUDNN_CHECK(cudnnCreate(&c.cudnn));
    TALLY_CUDNN_CHECK(cudnnSetStream(c.cudnn, c.compute));
  }
  return c.cudnn;
}
#endif

double* result_slot(double** device_ptr) {
  DeviceContext& c = context();
  *device_ptr = c.slot_device;
  return c.slot_host;
}

}  // namespace detail

// ---- devices and device memory -----------------------------------------------------------------
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver/no device" error
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  TALLY_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return p.name;
}

DeviceInfo device_info(int device) {
  cudaDeviceProp p{};
  TALLY_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  char bus[32] = {};
  TALLY_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  return {p.name, p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem, bus};
}

void* device_allocate(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it
    int dev = -1;
    (void)cudaGetDevice(&dev);
    std::size_t fr = 0, tot = 0;
    const bool known = cudaMemGetInfo(&fr, &tot) == cudaSuccess;
    if (!known) (void)cudaGetLastError();
    throw Error(fmt::format(
        "cudaMalloc of {} bytes ({:.1f} MiB) for the arena on cuda:{} failed: {} ({}); {} — reserve less "
        "(configure_arena(Device::cuda({}), bytes))",
        bytes, bytes / 1048576.0, dev, cudaGetErrorName(e), cudaGetErrorString(e),
        known ? fmt::format("the device has {} bytes ({:.1f} MiB) free of {} bytes ({:.1f} MiB)", fr, fr / 1048576.0,
                            tot, tot / 1048576.0)
              : std::string("the free device memory could not be read"),
        dev));
  }
  return p;
}

void device_free(void* p) noexcept { (void)cudaFree(p); }

void memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
  TALLY_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

// ---- a GPU described, not present ------------------------------------------------------------
namespace {
std::optional<DescribedDevice> g_described;
int g_described_serial = 0;  // a new number for each description set, for current_device()
}  // namespace

void set_described_device(std::optional<DescribedDevice> device) {
  g_described = std::move(device);
  if (g_described) ++g_described_serial;
}
const DescribedDevice* described_device() { return g_described ? &*g_described : nullptr; }

// ---- devices and streams ----------------------------------------------------------------------
void use_device(int device) {
  if (g_described) return;
  int cur = -1;
  TALLY_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) TALLY_CUDA_CHECK(cudaSetDevice(device));
}

int current_device() {
  if (g_described) return -1 - g_described_serial;
  int cur = 0;
  TALLY_CUDA_CHECK(cudaGetDevice(&cur));
  return cur;
}

CUstream_st* compute_stream() { return context().compute; }
CUstream_st* copy_stream() { return context().copy; }

void initialize() {
  (void)context();
#if TALLY_HAVE_CUDNN
  (void)detail::cudnn();
#endif
}

namespace {
std::atomic<std::uint64_t> g_host_syncs{0};
}  // namespace

namespace detail {
void host_wait(cudaStream_t s) {
  ++g_host_syncs;
  TALLY_CUDA_CHECK(cudaStreamSynchronize(s));
}
}  // namespace detail

void synchronize() { detail::host_wait(context().compute); }
void synchronize_device() {
  ++g_host_syncs;
  TALLY_CUDA_CHECK(cudaDeviceSynchronize());
}
std::uint64_t host_sync_count() { return g_host_syncs; }

// ---- copies (cuda_kernels.h) --------------------------------------------------------------------
// On the compute stream, in order with every kernel before them; the host-facing ones then wait
// for it, so that the host buffer may be read (device to host) or reused (host to device) as soon
// as the call returns. Device to device needs no wait: no host buffer is involved.
void copy_from_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  TALLY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, context().compute));
  synchronize();
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  TALLY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, context().compute));
  synchronize();
}
void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  TALLY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, context().compute));
}

std::string runtime_versions() {
  int driver = 0, runtime = 0, blas[3] = {0, 0, 0};
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  std::string s = fmt::format("driver {}.{}, runtime {}.{}", driver / 1000, driver % 1000 / 10, runtime / 1000,
                              runtime % 1000 / 10);
  try {
    const detail::CublasLibrary& lib = detail::cublas_library();
    (void)lib.get_property(MAJOR_VERSION, &blas[0]);
    (void)lib.get_property(MINOR_VERSION, &blas[1]);
    (void)lib.get_property(PATCH_LEVEL, &blas[2]);
    s += fmt::format(", cuBLAS {}.{}.{}", blas[0], blas[1], blas[2]);
  } catch (const Error& e) {
    s += fmt::format(", cuBLAS not loaded: {}", e.what());
  }
#if TALLY_HAVE_CUDNN
  const std::size_t v = cudnnGetVersion();  // major*10000 + minor*100 + patch since cuDNN 9
  s += fmt::format(", cuDNN {}.{}.{}", v / 10000, v % 10000 / 100, v % 100);
#endif
  return s;
}

std::size_t cudnn_version() {
#if TALLY_HAVE_CUDNN
  return cudnnGetVersion();
#else
  return 0;
#endif
}

// ---- switches ---------------------------------------------------------------------------------
void set_allow_tf32(bool on) { g_allow_tf32 = on; }
bool allow_tf32() { return g_allow_tf32; }
void set_deterministic(bool on) { g_deterministic = on; }
bool deterministic() { return g_deterministic; }

// ---- pinned memory ----------------------------------------------------------------------------
void* pinned_allocate(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(fmt::format("cudaHostAlloc of {} bytes ({:.1f} MiB) of pinned host memory (the host tier's arena, "
                            "input or message staging) failed: {} ({}); the host tier takes less with "
                            "--host-memory-limit",
                            bytes, static_cast<double>(bytes) / (1 << 20), cudaGetErrorName(e), cudaGetErrorString(e)));
  }
  return p;
}
void pinned_free(void* p) noexcept {
  if (p) (void)cudaFreeHost(p);
}

PinnedBuffer::PinnedBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaHostAlloc(&ptr_, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    throw Error(fmt::format("cudaHostAlloc of {} bytes of pinned host memory failed: {} ({})", bytes,
                            cudaGetErrorName(e), cudaGetErrorString(e)));
  }
}
PinnedBuffer::~PinnedBuffer() {
  if (ptr_) (void)cudaFreeHost(ptr_);
}
PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) (void)cudaFreeHost(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

// ---- events -----------------------------------------------------------------------------------
Event::~Event() {
  if (ev_) (void)cudaEventDestroy(ev_);
}
Event::Event(Event&& o) noexcept : ev_(o.ev_) { o.ev_ = nullptr; }
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (ev_) (void)cudaEventDestroy(ev_);
    ev_ = o.ev_;
    o.ev_ = nullptr;
  }
  return *this;
}

bool Event::done() const {
  if (!ev_) return true;
  const cudaError_t e = cudaEventQuery(ev_);
  if (e == cudaErrorNotReady) return false;
  TALLY_CUDA_CHECK(e);
  return true;
}

void Event::wait() const {
  if (!ev_) return;
  ++g_host_syncs;
  TALLY_CUDA_CHECK(cudaEventSynchronize(ev_));
}

Event Event::record(CUstream_st* stream) {
  cudaEvent_t ev = nullptr;
  TALLY_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  Event e(ev);  // owns it from here, also if the record below throws
  TALLY_CUDA_CHECK(cudaEventRecord(ev, stream));
  return e;
}

Event Event::record_timed(CUstream_st* stream) {
  cudaEvent_t ev = nullptr;
  TALLY_CUDA_CHECK(cudaEventCreate(&ev));
  Event e(ev);
  TALLY_CUDA_CHECK(cudaEventRecord(ev, stream));
  return e;
}

std::optional<float> elapsed_ms(const Event& start, const Event& stop) {
  if (!start.valid() || !stop.valid()) return std::nullopt;
  float ms = 0;
  const cudaError_t st = cudaEventElapsedTime(&ms, start.get(), stop.get());
  if (st == cudaErrorNotReady) return std::nullopt;
  TALLY_CUDA_CHECK(st);
  return ms;
}

Event upload_async(void* dst_device, const void* src_pinned, std::size_t bytes) {
  cudaStream_t s = copy_stream();
  if (bytes > 0) TALLY_CUDA_CHECK(cudaMemcpyAsync(dst_device, src_pinned, bytes, cudaMemcpyHostToDevice, s));
  return Event::record(s);
}

Event download_async(void* dst_pinned, const void* src_device, std::size_t bytes) {
  cudaStream_t s = copy_stream();
  if (bytes > 0) TALLY_CUDA_CHECK(cudaMemcpyAsync(dst_pinned, src_device, bytes, cudaMemcpyDeviceToHost, s));
  return Event::record(s);
}

Event download_on_compute(void* dst_pinned, const void* src_device, std::size_t bytes) {
  cudaStream_t s = compute_stream();
  if (bytes > 0) TALLY_CUDA_CHECK(cudaMemcpyAsync(dst_pinned, src_device, bytes, cudaMemcpyDeviceToHost, s));
  return Event::record(s);
}

void compute_wait(const Event& e) {
  if (e.valid()) TALLY_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), e.get(), 0));
}

void copy_wait(const Event& e) {
  if (e.valid()) TALLY_CUDA_CHECK(cudaStreamWaitEvent(copy_stream(), e.get(), 0));
}

// ---- CUDA graphs ---------------------------------------------------------------------------------
Graph::~Graph() {
  if (exec_) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}
Graph::Graph(Graph&& o) noexcept : exec_(o.exec_), nodes_(o.nodes_), device_bytes_(o.device_bytes_) {
  o.exec_ = nullptr;
}
Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    if (exec_) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = o.exec_, nodes_ = o.nodes_, device_bytes_ = o.device_bytes_;
    o.exec_ = nullptr;
  }
  return *this;
}

void Graph::launch() const {
  if (!exec_) throw Error("CUDA graph: launch of an empty graph");
  TALLY_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), context().compute));
}

void begin_capture() {
  TALLY_CUDA_CHECK(cudaStreamBeginCapture(context().compute, cudaStreamCaptureModeThreadLocal));
}

Graph end_capture() {
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(context().compute, &graph);
  if (ended != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();  // the capture's error is reported here, not by the next call
    throw Error(fmt::format("CUDA graph: the capture of the compute stream was broken ({}: {}); a call in the "
                            "captured work waits for the device or is not allowed in a capture",
                            cudaGetErrorName(ended), cudaGetErrorString(ended)));
  }
  Graph g;
  std::size_t free_before = 0, free_after = 0, total = 0;
  TALLY_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  std::size_t nodes = 0;
  (void)cudaGraphGetNodes(graph, nullptr, &nodes);
  (void)cudaGraphDestroy(graph);
  TALLY_CUDA_CHECK(made);
  g.exec_ = exec;
  g.nodes_ = nodes;
  TALLY_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  g.device_bytes_ = free_before > free_after ? free_before - free_after : 0;
  return g;
}

void abandon_capture() noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(context().compute, &status) != cudaSuccess || status == cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return;
  }
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(context().compute, &graph) == cudaSuccess && graph) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();
}

// ---- per-op GPU time ----------------------------------------------------------------------------
namespace {
bool profile_from_env() {
  const char* v = std::getenv("TALLY_PROFILE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}
std::atomic<bool> g_profiling{profile_from_env()};

// Each timed op: its name and the events around its launches; read once both have completed.
struct ProfileState {
  struct Pending {
    std::string name;
    Event start, stop;
  };
  std::mutex mu;
  std::vector<Pending> pending;  // recorded, not yet read
  ProfileTable table;
};
ProfileState& profile_state() {
  static auto* p = new ProfileState;  // never destroyed, as the contexts (its events outlive the runtime)
  return *p;
}
}  // namespace

void set_profiling(bool on) { g_profiling = on; }
bool profiling() { return g_profiling; }

OpTimer::OpTimer(const char* op, bool backward) {
  if (!g_profiling) return;
  ProfileState& p = profile_state();
  std::lock_guard<std::mutex> lock(p.mu);
  p.pending.push_back({std::string(op) + (backward ? " (backward)" : ""), Event::record_timed(compute_stream()), {}});
  op_ = op;
  backward_ = backward;
  mark_ = static_cast<std::int64_t>(p.pending.size()) - 1;  // the slot of its events
}

OpTimer::~OpTimer() {
  if (op_ == nullptr) return;
  ProfileState& p = profile_state();
  std::lock_guard<std::mutex> lock(p.mu);
  if (static_cast<std::size_t>(mark_) >= p.pending.size()) return;  // the table was reset meanwhile
  try {
    p.pending[static_cast<std::size_t>(mark_)].stop = Event::record_timed(compute_stream());
  } catch (const Error&) {
    // No stop event: the op goes uncounted (a destructor does not throw); the failure that
    // caused it surfaces at the next checked call.
  }
}

void profile_collect() {
  ProfileState& p = profile_state();
  std::lock_guard<std::mutex> lock(p.mu);
  std::size_t kept = 0;
  for (std::size_t i = 0; i < p.pending.size(); ++i) {
    auto& e = p.pending[i];
    const std::optional<float> ms = elapsed_ms(e.start, e.stop);
    if (!ms) {
      if (e.stop.valid() && !e.stop.done()) {  // still running: next time
        if (kept != i) p.pending[kept] = std::move(e);
        ++kept;
      }
      continue;
    }
    auto& row = p.table[e.name];
    ++row.calls;
    row.ms += *ms;
  }
  p.pending.resize(kept);
}

ProfileTable profile_table() {
  profile_collect();
  ProfileState& p = profile_state();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.table;
}

void profile_reset() {
  ProfileState& p = profile_state();
  std::lock_guard<std::mutex> lock(p.mu);
  // Work enqueued before the reset is not counted, finished or not: a step whose loss is read a
  // step late (core/pending.h) may still be running when the profile restarts after it.
  p.table.clear();
  p.pending.clear();
}

}  // namespace tally::kernels::cuda
