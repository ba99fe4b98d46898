// kernels/cuda/context.h — the CUDA context of tally, and the one home of its set-up: devices,
// device memory, streams, library handles, numerical switches, pinned host memory and overlapped
// uploads, and the per-op GPU timer. A plain C++ header (no CUDA headers), declared in every
// build: in a build without the CUDA backend nothing defines these functions, and core/ names
// them only in `if constexpr (kHaveCudaBackend)` branches (core/dispatch.h, core/device.cpp,
// core/staging.cpp, core/profiler.cpp),
// which such a build never compiles into code. The backend's own code reaches the handles
// through kernels/cuda/check.h (CUDA headers, checked calls), defined here in context.cpp.
//
// Per device, created on first use and kept for the life of the process (never destroyed: the
// CUDA runtime may already be torn down when static destructors run):
//   * a compute stream, on which every kernel, cuBLAS and cuDNN call and every copy of
//     core/ (copy_from_host, copy_to_host, copy_bytes in cuda_kernels.h) is enqueued. One stream means the arena can hand a freed block to
//     the next op at once: stream order keeps the old reader before the new writer. It is a
//     blocking stream, so stray work on the legacy default stream is still ordered with it.
//   * a copy stream (non-blocking) for host-to-device uploads that overlap compute;
//   * a cuBLAS handle and a cuDNN handle bound to the compute stream (cuDNN's is created on the
//     first convolution: loading cuDNN takes a while).
// The handles are not thread-safe: one host thread drives a device at a time.
//
// Switches (process-wide, read when a call is made):
//   * allow_tf32 (default false): float32 GEMMs and convolutions may use TF32 tensor cores.
//     Off, cuBLAS runs CUBLAS_COMPUTE_32F and cuDNN CUDNN_FMA_MATH — cuDNN's *default* math
//     allows TF32 on Ampere and newer, so "off" must be said explicitly.
//   * deterministic (default true): cuDNN may only pick algorithms it reports deterministic.
//     tally's own kernels are deterministic either way.
// The cuDNN algorithm cache is keyed by these settings as well as the shape (whose
// workspace_limit, like the cuBLAS workspace, core/ derives from the arena's budget: see
// cuda_kernels.h), so changing a switch between a dry run and the real run is seen as a
// different convolution, never a stale choice.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

struct CUstream_st;  // cudaStream_t is CUstream_st*
struct CUevent_st;   // cudaEvent_t is CUevent_st*

namespace tally::kernels::cuda {

// ---- devices and device memory -----------------------------------------------------------------
int device_count();  // 0 when there is no driver or no GPU (never throws)
std::string device_name(int device);
// What a plan needs to know of a GPU besides cuDNN's description of it (core/device_file.h).
struct DeviceInfo {
  std::string name;
  int compute_major = 0, compute_minor = 0, multiprocessors = 0;
  std::size_t total_memory = 0;
  std::string bus_id;  // PCI "domain:bus:device.function" (cudaDeviceGetPCIBusId): one physical GPU
};
DeviceInfo device_info(int device);
// cudaMalloc on the current device, for an arena's reservation: a failure throws tally::Error
// naming the bytes asked and the device's free and total memory.
void* device_allocate(std::size_t bytes);
void device_free(void* p) noexcept;
// cudaHostAlloc of `bytes` of page-locked host memory (the host tier's arena), a failure a
// tally::Error naming the bytes; its release.
void* pinned_allocate(std::size_t bytes);
void pinned_free(void* p) noexcept;
// The current device's free and total memory (cudaMemGetInfo).
void memory_info(std::size_t* free_bytes, std::size_t* total_bytes);

// ---- a GPU described, not present ---------------------------------------------------------------
// Plans without the GPU (docs/gpu.md, "Plans without the GPU"; core/device_file.h): while a
// description is set, the questions a dry run asks of "the GPU" are answered from it and no CUDA
// call is made — use_device does nothing, current_device() is negative (no real device's index,
// so cached choices never mix), gemm_workspace_bytes reads the description's compute capability
// and the convolutions plan through cuDNN's graph API from cuDNN's description (conv.cu). Only dry
// runs may run then: a kernel has no device to run on. Set it before planning and clear it after,
// never while another thread plans.
struct DescribedDevice {
  std::string name;
  int compute_major = 0, compute_minor = 0;
  std::string cudnn_properties;  // cuDNN's description (CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION)
};
void set_described_device(std::optional<DescribedDevice> device);
const DescribedDevice* described_device();  // null when none is set

// ---- devices and streams --------------------------------------------------------------------
// Makes `device` current on this thread (cudaSetDevice only when it is not already).
void use_device(int device);
// The current device's index; with a described device, -1 - the description's serial number.
int current_device();
// Streams of the current device.
CUstream_st* compute_stream();
CUstream_st* copy_stream();
// Creates the current device's context now: streams, cuBLAS and cuDNN handles. They take device
// memory outside the arena, so core/ calls this before it measures the free memory that the
// default arena reserves.
void initialize();
// Waits until everything enqueued on the current device's compute stream has finished; throws
// tally::Error if a kernel failed.
void synchronize();
// Every host-blocking CUDA call of core/ and kernels/cuda/ (stream, device and event waits, and
// the copies that wait) goes through one counter: a test asserts how many a training step makes.
std::uint64_t host_sync_count();
// Waits for the whole device (cudaDeviceSynchronize), counted.
void synchronize_device();

// The versions loaded at run time (which may differ from the headers built against):
// "driver 13.0, runtime 13.0, cuBLAS 13.0.2, cuDNN 9.19.0".
std::string runtime_versions();
// cudnnGetVersion() of the cuDNN loaded (major*10000 + minor*100 + patch); 0 in a build without cuDNN.
std::size_t cudnn_version();

// ---- switches ---------------------------------------------------------------------------------
void set_allow_tf32(bool on);
bool allow_tf32();
void set_deterministic(bool on);
bool deterministic();

// ---- pinned host memory -----------------------------------------------------------------------
// Page-locked host memory (cudaHostAlloc): the source of an asynchronous upload must be pinned,
// or the copy degrades to a synchronous staged one. Move-only; frees itself.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  std::size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// ---- events and overlapped uploads ------------------------------------------------------------
// A CUDA event (timing disabled), move-only. Default-constructed: no event, already "complete".
class Event {
 public:
  Event() = default;
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  bool valid() const { return ev_ != nullptr; }
  bool done() const;  // cudaEventQuery
  void wait() const;  // the host waits (cudaEventSynchronize)
  CUevent_st* get() const { return ev_; }
  static Event record(CUstream_st* stream);        // a new event recorded on `stream`
  static Event record_timed(CUstream_st* stream);  // the same with timing on (the profiler's)

 private:
  explicit Event(CUevent_st* ev) : ev_(ev) {}
  CUevent_st* ev_ = nullptr;
};

// Milliseconds between two completed timed events; nothing while either is still pending.
std::optional<float> elapsed_ms(const Event& start, const Event& stop);

// Copies `bytes` from pinned host memory to device memory on the copy stream and returns the
// event that marks its completion; the compute stream does NOT wait for it until compute_wait().
// Preconditions, the caller's to keep (the MBP executor's double-buffered inputs do):
//   * `src_pinned` stays alive and unchanged until the event is done;
//   * nothing already enqueued on the compute stream still reads or writes `dst_device` — use a
//     buffer set aside for uploads, not a block the arena just handed back, or first make the
//     copy stream wait for the compute stream with copy_wait(Event::record(compute_stream())).
Event upload_async(void* dst_device, const void* src_pinned, std::size_t bytes);
// Copies `bytes` from device memory to pinned host memory on the copy stream and returns the event
// that marks its completion (an offloaded segment's activations, core/offload.h); the same
// preconditions, mirrored: the copy stream must first wait for the compute work that wrote
// `src_device`, and nothing may reuse `src_device` before the event (compute_wait) or read
// `dst_pinned` on the host before it is done.
Event download_async(void* dst_pinned, const void* src_device, std::size_t bytes);
// The same copy on the compute stream: after the work enqueued there, before the work enqueued
// after it, so no stream waits for another. For a few bytes read a step late (core/pending.h): on
// the copy stream such a read waited for the whole step and held back every upload enqueued
// after it — the next step's first input among them.
Event download_on_compute(void* dst_pinned, const void* src_device, std::size_t bytes);
// Work enqueued on the compute stream from now on waits for `e` (no host wait).
void compute_wait(const Event& e);
// Work enqueued on the copy stream from now on waits for `e` (no host wait).
void copy_wait(const Event& e);

// ---- CUDA graphs ------------------------------------------------------------------------------
// The compute stream's work recorded once (stream capture) and launched again as one call: what a
// micro-batch's forward and backward enqueue, replayed without their host code (core/graphs.h).
// begin_capture() starts recording the current device's compute stream (thread-local mode: other
// threads' CUDA calls are not affected); until end_capture() nothing enqueued there runs, and a
// call that would wait for the stream is an error that ends the capture. end_capture() stops it
// and instantiates the graph — or, if the capture was broken (an unsupported call in between),
// throws tally::Error naming CUDA's reason. abandon_capture() stops a capture an exception left
// open, discarding it (never throws). A Graph is move-only and destroys itself.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  bool valid() const { return exec_ != nullptr; }
  void launch() const;  // on the compute stream (no host wait)
  std::size_t nodes() const { return nodes_; }
  // The device memory instantiating it took (free memory before and after), outside the arena.
  std::size_t device_bytes() const { return device_bytes_; }

 private:
  friend Graph end_capture();
  void* exec_ = nullptr;  // cudaGraphExec_t
  std::size_t nodes_ = 0, device_bytes_ = 0;
};
void begin_capture();
Graph end_capture();
void abandon_capture() noexcept;

// The per-op GPU time (set_profiling, OpTimer, profile_collect, ...) is the backend contract's:
// kernels/backend.inc, declared through kernels/cuda/cuda_kernels.h.

}  // namespace tally::kernels::cuda
