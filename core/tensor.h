// core/tensor.h — Storage (a block of an arena) and Tensor (a strided view of a Storage).
//
// A Tensor is a cheap handle (shared_ptr to TensorImpl), like torch::Tensor: copying it aliases.
// TensorImpl = shared Storage + offset (elements) + shape + strides (elements) + dtype + device,
// plus autograd metadata. A Storage owns one arena allocation with a Category and frees it when
// the last view goes away. In a dry run (core/memory.h) storages live in a virtual arena and
// data pointers are null: nothing may read or write them.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "kernels/common.h"  // kernels::bf16

namespace tally {
class Tensor;
namespace detail {
// Writes `src` converted to `dst`'s dtype into `dst` (same shape and device, dense): the
// conversion kernel of Tensor::to and of cast's backward, with no history.
void convert_into(const Tensor& src, Tensor& dst);
}  // namespace detail

using Shape = std::vector<std::int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
std::int64_t shape_numel(const Shape& s);

// The most values one sample of a model's input (C x H x W) may have: 2^31 - 1, what the libraries
// accept — cuDNN's 4-d descriptors take int strides, and oneDNN's convolution setup divides by zero
// on a plane of 2^32 pixels (dnnl_primitive_desc_iterator_create, SIGFPE). sample_shape_error:
// "" when `sample` has at least one dimension, every dimension >= 1 and at most that many values;
// else what is wrong, in words ("3x65536x65536 is 12884901888 values a sample; at most 2147483647").
inline constexpr std::int64_t kMaxSampleValues = (std::int64_t{1} << 31) - 1;
std::string sample_shape_error(const Shape& sample);

// How a dense 4-d tensor (N, C, H, W) lays out its elements, as torch.memory_format: Contiguous is
// row-major NCHW; ChannelsLast keeps the shape (N, C, H, W) and stores NHWC (strides H*W*C, 1,
// W*C, C) — the layout oneDNN's direct convolutions run on without reordering, so that a network
// whose input is channels-last stays channels-last from convolution to convolution (docs/memory-format.md).
// Only 4-d tensors have a channels-last layout.
enum class MemoryFormat { Contiguous, ChannelsLast };
const char* memory_format_name(MemoryFormat f);  // "contiguous", "channels_last"
// The layout `device`'s convolutions run fastest in, as tally is built and set now: ChannelsLast on
// a CPU whose convolutions run on oneDNN; on CUDA ChannelsLast where the convolutions run on tensor
// cores (`tensor_cores`: bf16, or float32 with TF32 on) and Contiguous for plain float32, whose
// NHWC engines are slower (docs/gpu.md, "Channels-last on the GPU"); else Contiguous.
MemoryFormat preferred_memory_format(Device device, bool tensor_cores = false);

class Storage {
 public:
  Storage(std::shared_ptr<Arena> arena, std::size_t bytes, Category category, const std::string& op);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  std::size_t nbytes() const { return bytes_; }
  std::size_t offset() const { return offset_; }  // of its block in arena()
  const std::string& op() const { return op_; }
  Device device() const { return arena_->device(); }
  Category category() const { return category_; }
  const std::shared_ptr<Arena>& arena() const { return arena_; }
  // Moves the bytes to a new block of `to` (same size, category and op; every view of this storage
  // follows): `copy(dst, src, bytes)` copies them — skipped in a dry run, whose blocks have no
  // memory — then the old block is freed. An offloaded segment's activations between the device's
  // arena and the host tier's (core/offload.h).
  using Copy = std::function<void(void* dst, const void* src, std::size_t bytes)>;
  void relocate(std::shared_ptr<Arena> to, const Copy& copy);

 private:
  std::shared_ptr<Arena> arena_;
  std::size_t offset_, bytes_;
  void* ptr_;
  Category category_;
  std::string op_;
};

// Records every storage Tensor::empty makes on this thread while it is alive (weakly: it keeps
// none alive), for it and every watch around it: what an offloaded segment's forward made
// (core/offload.h).
class StorageWatch {
 public:
  StorageWatch();
  ~StorageWatch();
  StorageWatch(const StorageWatch&) = delete;
  StorageWatch& operator=(const StorageWatch&) = delete;
  const std::vector<std::weak_ptr<Storage>>& made() const { return made_; }
  // Called by Tensor::empty for each new storage.
  static void record(const std::shared_ptr<Storage>& s);

 private:
  StorageWatch* outer_;
  std::vector<std::weak_ptr<Storage>> made_;
};

struct Node;  // core/autograd.h
class Tensor;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  std::int64_t offset = 0;  // in elements
  Shape shape, strides;
  DType dtype = DType::Float32;
  Device device;
  // autograd
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  std::shared_ptr<TensorImpl> grad;  // persistent gradient buffer of a leaf (category gradient)
  // The category of the gradient buffer backward allocates for this leaf: gradient for
  // parameters; temporary for the detached input of a recomputed segment (core/autograd.h).
  Category grad_category = Category::gradient;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- creation (bytes come from the current arena of `device`) ------------------------------
  static Tensor empty(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu(),
                      Category category = Category::activation, const std::string& op = "empty",
                      MemoryFormat format = MemoryFormat::Contiguous);
  static Tensor zeros(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu(),
                      Category category = Category::activation, const std::string& op = "zeros");
  static Tensor full(const Shape& shape, double value, DType dtype = DType::Float32,
                     Device device = Device::cpu(), Category category = Category::activation,
                     const std::string& op = "full");
  // From host values; the length must equal the product of `shape`.
  static Tensor from_vector(const std::vector<float>& v, const Shape& shape, Device device = Device::cpu(),
                            Category category = Category::input);
  static Tensor from_vector(const std::vector<double>& v, const Shape& shape, Device device = Device::cpu(),
                            Category category = Category::input);
  static Tensor from_vector(const std::vector<std::int64_t>& v, const Shape& shape,
                            Device device = Device::cpu(), Category category = Category::input);
  static Tensor from_vector(const std::vector<kernels::bf16>& v, const Shape& shape, Device device = Device::cpu(),
                            Category category = Category::input);
  // Copies to host (any layout); T must match the dtype (float, double, std::int32_t,
  // std::int64_t, kernels::bf16).
  template <class T>
  std::vector<T> to_vector() const;
  double item() const;  // a one-element tensor's value as double

  // ---- properties -------------------------------------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  std::int64_t dim() const { return static_cast<std::int64_t>(impl().shape.size()); }
  std::int64_t size(std::int64_t d) const;  // negative d counts from the end
  std::int64_t numel() const { return shape_numel(impl().shape); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().device; }
  std::int64_t offset() const { return impl().offset; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }
  bool is_contiguous() const;  // row-major (MemoryFormat::Contiguous)
  bool is_contiguous(MemoryFormat format) const;
  // ChannelsLast for a 4-d tensor stored channels-last and not also row-major (where both hold,
  // e.g. C == 1 or H == W == 1, the layouts are the same bytes: Contiguous); else Contiguous.
  // Ops that run in either layout give their output this format of their input (torch's rule).
  MemoryFormat suggest_memory_format() const;
  Category category() const { return impl().storage->category(); }
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  std::string str() const;  // "float32[2, 3] on cpu"

  void* raw_data() const;  // address of element 0 (null in a dry run)
  template <class T>
  T* data() const { return static_cast<T*>(raw_data()); }

  // ---- views and copies ----------------------------------------------------------------------
  Tensor view(Shape shape) const;      // same storage; needs a contiguous tensor; one -1 allowed
  Tensor reshape(Shape shape) const;   // view if contiguous, else a contiguous copy
  Tensor transpose(std::int64_t d0, std::int64_t d1) const;  // view
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;  // view
  Tensor contiguous() const;           // itself if contiguous, else a dense copy (no autograd)
  // Itself if dense in `format`, else a copy in it (no autograd); ChannelsLast needs 4 dimensions.
  Tensor contiguous(MemoryFormat format) const;
  Tensor clone(Category category) const;  // dense copy (no autograd)
  Tensor to(Device device) const;      // copy to another device (same category), or itself
  // A converting copy among float32, float64 and bfloat16 (same category), or itself. An op with a
  // gradient (core/ops.h cast): the output's gradient flows back converted to this dtype.
  Tensor to(DType dtype) const;
  void copy_(const Tensor& src);       // element-wise copy of same shape, any devices and layouts
  // Moves this tensor's bytes into `arena` (of any device) in place, values kept (a copy, skipped
  // in a dry run), the old bytes freed: every handle of it sees the new place and device. For a
  // tensor that owns its storage whole (dense, offset 0) and is no node of autograd: optimizer
  // state placed in the host tier (optim/optimizer.h). `op` names the new allocation.
  void move_to(const std::shared_ptr<Arena>& arena, const std::string& op);
  void fill_(double value);            // a dense tensor of either memory format
  void zero_() { fill_(0.0); }

  // ---- autograd (core/autograd.h) ----------------------------------------------------------
  bool requires_grad() const { return impl().requires_grad; }
  // Marks a leaf as needing a gradient. The gradient buffer is allocated lazily on the first
  // backward (category gradient) unless allocate_grad() made it already.
  Tensor& set_requires_grad(bool on);
  // Allocates the persistent gradient buffer now, zero-filled (how Parameters get theirs, so the
  // buffer is counted before any step and accumulation needs no extra memory).
  void allocate_grad();
  Tensor grad() const;  // undefined if none
  void zero_grad();     // fills the gradient buffer with zeros (keeps it)
  const std::shared_ptr<Node>& grad_fn() const { return impl().grad_fn; }
  bool is_leaf() const { return impl().grad_fn == nullptr; }
  Tensor detach() const;  // shares storage, no history
  // Reverse-mode differentiation from this scalar (one-element) tensor.
  void backward() const;

  TensorImpl& impl() const;
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Throws ShapeError "op: expected ..., found ..." helpers used by every op.
void check_same_device(const char* op, const Tensor& a, const Tensor& b);
void check_same_dtype(const char* op, const Tensor& a, const Tensor& b);
void check_same_shape(const char* op, const Tensor& a, const Tensor& b);
void check_dim(const char* op, const char* what, const Tensor& t, std::int64_t dim);
// A float32, float64 (cpu) or bfloat16 tensor.
void check_floating(const char* op, const Tensor& t);
// A parameter `what` of an op on activations x: x's device, dtype param_dtype(x.dtype()).
void check_param(const char* op, const char* what, const Tensor& x, const Tensor& p);

}  // namespace tally
