// core/tensor.cpp — Storage and Tensor: creation, views, copies between devices.
#include "core/tensor.h"

#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/autograd.h"
#include "core/dispatch.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/ops.h"

namespace tally {

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

std::int64_t shape_numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string sample_shape_error(const Shape& sample) {
  const std::string text = fmt::format("{}", fmt::join(sample, "x"));
  if (sample.empty()) return "a sample needs at least one dimension, found none";
  double values = 1;  // in double: the product of the dimensions may not fit 64 bits
  for (std::int64_t d : sample) {
    if (d < 1) return fmt::format("{}: every dimension must be >= 1, found {}", text, d);
    values *= static_cast<double>(d);
  }
  if (values > static_cast<double>(kMaxSampleValues))
    return fmt::format("{} is {:.0f} values a sample; at most {} (2^31 - 1, what cuDNN's descriptors and oneDNN's "
                       "convolutions accept)", text, values, kMaxSampleValues);
  return "";
}

namespace {
Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  std::int64_t acc = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= std::max<std::int64_t>(shape[i], 1);
  }
  return st;
}

// NHWC strides of a 4-d shape (N, C, H, W).
Shape channels_last_strides(const Shape& shape) {
  auto d = [&](std::size_t i) { return std::max<std::int64_t>(shape[i], 1); };
  return {d(1) * d(2) * d(3), 1, d(3) * d(1), d(1)};
}

// Strides of `format` for `shape`; ChannelsLast needs 4 dimensions.
Shape strides_for(const Shape& shape, MemoryFormat format, const char* op) {
  if (format == MemoryFormat::Contiguous) return contiguous_strides(shape);
  if (shape.size() != 4)
    throw ShapeError(fmt::format("{}: channels_last is a layout of 4-d tensors (N, C, H, W), found shape {}", op,
                                 shape_str(shape)));
  return channels_last_strides(shape);
}

// (N, C, H, W) seen as (N, H, W, C): a channels-last tensor's bytes in row-major order.
Tensor nhwc_view(const Tensor& t) { return t.transpose(1, 2).transpose(2, 3); }

void check_shape_valid(const Shape& shape, const char* op) {
  for (auto d : shape)
    if (d < 0) throw ShapeError(fmt::format("{}: negative dimension in shape {}", op, shape_str(shape)));
}

template <class T>
Tensor from_host(const std::vector<T>& v, const Shape& shape, DType dt, Device device, Category cat) {
  check_shape_valid(shape, "from_vector");
  if (static_cast<std::int64_t>(v.size()) != shape_numel(shape))
    throw ShapeError(fmt::format("from_vector: shape {} needs {} values, found {}", shape_str(shape),
                                 shape_numel(shape), v.size()));
  Tensor t = Tensor::empty(shape, dt, device, cat, "from_vector");
  TALLY_DISPATCH("from_vector", t, ANY, kk::copy_from_host(t.raw_data(), v.data(), v.size() * sizeof(T)));
  return t;
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::Float32;
  if constexpr (std::is_same_v<T, double>) return DType::Float64;
  if constexpr (std::is_same_v<T, std::int32_t>) return DType::Int32;
  if constexpr (std::is_same_v<T, kernels::bf16>) return DType::BFloat16;
  return DType::Int64;
}

// Dense copy of a tensor into dst (contiguous, same numel, same device as src), on src's device.
void gather(const Tensor& src, void* dst) {
  const int nd = static_cast<int>(src.dim());
  if (nd > 8) throw ShapeError(fmt::format("contiguous: at most 8 dimensions, found {}", nd));
  Shape shape = src.shape(), strides = src.strides();
  if (nd == 0) {
    shape = {1};
    strides = {1};
  }
  const int ndim = static_cast<int>(shape.size());
  TALLY_DISPATCH("contiguous", src, ALL,
                 kk::strided_copy<T>(ndim, shape.data(), strides.data(), src.data<T>(), static_cast<T*>(dst)));
}
}  // namespace

// ---- Storage ----------------------------------------------------------------------------------
Storage::Storage(std::shared_ptr<Arena> arena, std::size_t bytes, Category category, const std::string& op)
    : arena_(std::move(arena)), bytes_(bytes), category_(category), op_(op) {
  const Block b = arena_->allocate(bytes, category, op);
  offset_ = b.offset;
  ptr_ = b.ptr;
}
Storage::~Storage() { arena_->free(offset_); }

void Storage::relocate(std::shared_ptr<Arena> to, const Copy& copy) {
  if (!to) throw Error(fmt::format("Storage::relocate: expected an arena for '{}', found none", op_));
  if (to == arena_) return;
  const Block b = to->allocate(bytes_, category_, op_);
  if (b.ptr && ptr_ && bytes_ > 0) copy(b.ptr, ptr_, bytes_);
  arena_->free(offset_);
  arena_ = std::move(to);
  offset_ = b.offset;
  ptr_ = b.ptr;
}

namespace {
thread_local StorageWatch* tl_watch = nullptr;
}  // namespace

StorageWatch::StorageWatch() : outer_(tl_watch) { tl_watch = this; }
StorageWatch::~StorageWatch() { tl_watch = outer_; }
void StorageWatch::record(const std::shared_ptr<Storage>& s) {
  for (StorageWatch* w = tl_watch; w; w = w->outer_) w->made_.push_back(s);
}

// ---- Tensor: creation -------------------------------------------------------------------------
const char* memory_format_name(MemoryFormat f) {
  return f == MemoryFormat::ChannelsLast ? "channels_last" : "contiguous";
}

MemoryFormat preferred_memory_format(Device device, bool tensor_cores) {
  // CUDA, ResNet-50 batch 256 on an H200 (bench/RESULTS.md, 2026-11-28), NHWC against NCHW: TF32
  // 2,055 against 1,476 images/s, bf16 1,280 against 1,115, float32 445 against 703.
  const bool nhwc = device.is_cpu() ? cpu_convolutions_use_onednn() : tensor_cores;
  return nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, Category category, const std::string& op,
                     MemoryFormat format) {
  check_shape_valid(shape, op.c_str());
  const Shape strides = strides_for(shape, format, op.c_str());
  auto impl = std::make_shared<TensorImpl>();
  const std::size_t bytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  impl->storage = std::make_shared<Storage>(current_arena(device), bytes, category, op);
  StorageWatch::record(impl->storage);
  impl->shape = shape;
  impl->strides = strides;
  impl->dtype = dtype;
  impl->device = device;
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, Category category, const std::string& op) {
  return full(shape, 0.0, dtype, device, category, op);
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device, Category category,
                    const std::string& op) {
  Tensor t = empty(shape, dtype, device, category, op);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& v, const Shape& s, Device d, Category c) {
  return from_host(v, s, DType::Float32, d, c);
}
Tensor Tensor::from_vector(const std::vector<double>& v, const Shape& s, Device d, Category c) {
  return from_host(v, s, DType::Float64, d, c);
}
Tensor Tensor::from_vector(const std::vector<std::int64_t>& v, const Shape& s, Device d, Category c) {
  return from_host(v, s, DType::Int64, d, c);
}
Tensor Tensor::from_vector(const std::vector<kernels::bf16>& v, const Shape& s, Device d, Category c) {
  return from_host(v, s, DType::BFloat16, d, c);
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  if (dtype() != dtype_of<T>())
    throw ShapeError(fmt::format("to_vector: tensor {} read as {}", str(), dtype_name(dtype_of<T>())));
  if (is_dry_run() || raw_data() == nullptr)
    throw Error(fmt::format("to_vector: tensor {} has no data (dry run)", str()));
  Tensor c = device().is_cpu() ? contiguous() : contiguous().to(Device::cpu());
  std::vector<T> out(static_cast<std::size_t>(c.numel()));
  if (!out.empty()) std::memcpy(out.data(), c.raw_data(), out.size() * sizeof(T));
  return out;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<std::int64_t> Tensor::to_vector<std::int64_t>() const;
template std::vector<std::int32_t> Tensor::to_vector<std::int32_t>() const;
template std::vector<kernels::bf16> Tensor::to_vector<kernels::bf16>() const;

double Tensor::item() const {
  if (numel() != 1) throw ShapeError(fmt::format("item: expected one element, found {}", str()));
  switch (dtype()) {
    case DType::Float32: return to_vector<float>()[0];
    case DType::Float64: return to_vector<double>()[0];
    case DType::Int64: return static_cast<double>(to_vector<std::int64_t>()[0]);
    case DType::Int32: return to_vector<std::int32_t>()[0];
    case DType::BFloat16: return to(DType::Float32).item();
    default: throw ShapeError(fmt::format("item: unsupported dtype {}", dtype_name(dtype())));
  }
}

// ---- Tensor: properties -----------------------------------------------------------------------
TensorImpl& Tensor::impl() const {
  if (!impl_) throw Error("use of an undefined tensor");
  return *impl_;
}

std::int64_t Tensor::size(std::int64_t d) const {
  const std::int64_t n = dim();
  if (d < -n || d >= n) throw ShapeError(fmt::format("size: dimension {} out of range for {}", d, str()));
  return shape()[static_cast<std::size_t>(d < 0 ? d + n : d)];
}

bool Tensor::is_contiguous() const { return is_contiguous(MemoryFormat::Contiguous); }

bool Tensor::is_contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::ChannelsLast && dim() != 4) return false;
  const Shape expect = format == MemoryFormat::Contiguous ? contiguous_strides(shape()) : channels_last_strides(shape());
  for (std::size_t i = 0; i < expect.size(); ++i)
    if (shape()[i] != 1 && strides()[i] != expect[i]) return false;
  return true;
}

MemoryFormat Tensor::suggest_memory_format() const {
  return is_contiguous(MemoryFormat::ChannelsLast) && !is_contiguous() ? MemoryFormat::ChannelsLast
                                                                        : MemoryFormat::Contiguous;
}

std::string Tensor::str() const {
  if (!impl_) return "undefined tensor";
  return fmt::format("{}{} on {}", dtype_name(dtype()), shape_str(shape()), device().str());
}

void* Tensor::raw_data() const {
  void* base = impl().storage->data();
  if (!base) return nullptr;
  return static_cast<char*>(base) + offset() * static_cast<std::int64_t>(dtype_size(dtype()));
}

// ---- views and copies -------------------------------------------------------------------------
Tensor Tensor::view(Shape s) const {
  int infer = -1;
  std::int64_t known = 1;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      if (infer >= 0) throw ShapeError(fmt::format("view: more than one -1 in {}", shape_str(s)));
      infer = static_cast<int>(i);
    } else {
      if (s[i] < 0) throw ShapeError(fmt::format("view: invalid shape {}", shape_str(s)));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel() % known != 0)
      throw ShapeError(fmt::format("view: cannot view {} as {}", str(), shape_str(s)));
    s[static_cast<std::size_t>(infer)] = numel() / known;
  }
  if (shape_numel(s) != numel())
    throw ShapeError(fmt::format("view: cannot view {} ({} elements) as {} ({} elements)", str(), numel(),
                                 shape_str(s), shape_numel(s)));
  if (!is_contiguous())
    throw ShapeError(fmt::format("view: {} is not contiguous; use reshape()", str()));
  Tensor v = detach();  // views share the storage and carry no history
  v.impl().shape = s;
  v.impl().strides = contiguous_strides(s);
  return v;
}

Tensor Tensor::reshape(Shape s) const { return is_contiguous() ? view(std::move(s)) : contiguous().view(std::move(s)); }

Tensor Tensor::transpose(std::int64_t d0, std::int64_t d1) const {
  const std::int64_t n = dim();
  if (d0 < 0) d0 += n;
  if (d1 < 0) d1 += n;
  if (d0 < 0 || d0 >= n || d1 < 0 || d1 >= n)
    throw ShapeError(fmt::format("transpose: dimensions ({}, {}) out of range for {}", d0, d1, str()));
  Tensor v = detach();
  std::swap(v.impl().shape[d0], v.impl().shape[d1]);
  std::swap(v.impl().strides[d0], v.impl().strides[d1]);
  return v;
}

Tensor Tensor::narrow(std::int64_t d, std::int64_t start, std::int64_t length) const {
  const std::int64_t n = dim();
  if (d < 0) d += n;
  if (d < 0 || d >= n || start < 0 || length < 0 || start + length > shape()[d])
    throw ShapeError(fmt::format("narrow: dim {} start {} length {} out of range for {}", d, start, length, str()));
  Tensor v = detach();
  v.impl().shape[d] = length;
  v.impl().offset += start * v.impl().strides[d];
  return v;
}

Tensor Tensor::clone(Category category) const {
  Tensor out = empty(shape(), dtype(), device(), category, "clone");
  out.copy_(*this);
  return out;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone(category());
}

Tensor Tensor::contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::Contiguous) return contiguous();
  if (is_contiguous(format)) return *this;
  Tensor out = empty(shape(), dtype(), device(), category(), "contiguous", format);
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor out = empty(shape(), dtype(), d, category(), "to");
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType t) const {
  if (t == dtype()) return *this;
  return cast(*this, t);
}

void detail::convert_into(const Tensor& src_, Tensor& dst) {
  const auto storage = [](DType d) { return d == DType::Float32 || d == DType::Float64 || d == DType::BFloat16; };
  if (!storage(src_.dtype()) || !storage(dst.dtype()))
    throw Error(fmt::format("to: no conversion from {} to {} (float32, float64 and bfloat16 convert to one another)",
                            dtype_name(src_.dtype()), dtype_name(dst.dtype())));
  const MemoryFormat format = dst.suggest_memory_format();
  if (src_.shape() != dst.shape() || src_.device() != dst.device() || !dst.is_contiguous(format))
    throw ShapeError(fmt::format("to: cannot convert {} into {}", src_.str(), dst.str()));
  const Tensor src = src_.contiguous(format);  // the same layout: the conversion runs over the bytes
  // The source type bound as S (a query: no kernel of its own), then the conversion kernel.
  TALLY_DISPATCH_QUERY("to", src, FLOAT_STORAGE, {
    using S = T;
    TALLY_DISPATCH("to", dst, FLOAT_STORAGE, kk::convert<S, T>(src.numel(), src.data<S>(), dst.data<T>()));
  });
}

void Tensor::copy_(const Tensor& src) {
  if (src.shape() != shape() || src.dtype() != dtype())
    throw ShapeError(fmt::format("copy_: destination {} and source {} differ in shape or dtype", str(), src.str()));
  if (!is_contiguous()) {
    // A channels-last destination: the same copy between the two seen as (N, H, W, C), where the
    // destination is row-major (a dense copy when the source is channels-last too).
    if (!is_contiguous(MemoryFormat::ChannelsLast))
      throw ShapeError(fmt::format("copy_: destination {} must be dense (contiguous or channels_last)", str()));
    Tensor d = nhwc_view(*this);
    return d.copy_(nhwc_view(src));
  }
  if (numel() == 0) return;
  const std::size_t bytes = nbytes();
  if (src.device() == device()) {  // one device: a dense copy, or a gather of a strided view
    if (!src.is_contiguous()) return gather(src, raw_data());
    TALLY_DISPATCH("copy_", *this, ANY, kk::copy_bytes(raw_data(), src.raw_data(), bytes));
  } else if (src.device().is_cpu()) {  // host to GPU: gathered on the host, then one upload
    const Tensor dense = src.contiguous();
    TALLY_DISPATCH("copy_", *this, ANY, kk::copy_from_host(raw_data(), dense.raw_data(), bytes));
  } else if (!src.is_contiguous()) {  // a strided GPU source: gathered on its device first
    Tensor dense = empty(src.shape(), src.dtype(), src.device(), Category::temporary, "copy_gather");
    gather(src, dense.raw_data());
    copy_(dense);
  } else if (device().is_cpu()) {  // GPU to host
    TALLY_DISPATCH("copy_", src, ANY, kk::copy_to_host(raw_data(), src.raw_data(), bytes));
  } else {  // GPU to another GPU
    TALLY_DISPATCH("copy_", *this, ANY, kk::copy_bytes(raw_data(), src.raw_data(), bytes));
  }
}

void Tensor::move_to(const std::shared_ptr<Arena>& arena, const std::string& op) {
  TensorImpl& t = impl();
  if (!arena) throw Error(fmt::format("move_to: expected an arena for {}, found none", str()));
  if (t.storage->arena() == arena) return;
  if (!is_contiguous() || t.offset != 0 || t.storage->nbytes() != nbytes())
    throw ShapeError(fmt::format("move_to: {} must own its storage whole (dense, offset 0)", str()));
  if (t.grad_fn || t.requires_grad)
    throw Error(fmt::format("move_to: {} takes part in autograd; only plain tensors move between arenas", str()));
  auto to = std::make_shared<TensorImpl>();
  to->storage = std::make_shared<Storage>(arena, nbytes(), t.storage->category(), op);
  to->shape = t.shape;
  to->strides = t.strides;
  to->dtype = t.dtype;
  to->device = arena->device();
  Tensor(to).copy_(*this);
  t.storage = std::move(to->storage);
  t.device = arena->device();
}

void Tensor::fill_(double value) {
  if (!is_contiguous() && !is_contiguous(MemoryFormat::ChannelsLast))
    throw ShapeError(fmt::format("fill_: {} must be dense (contiguous or channels_last)", str()));
  if (numel() == 0) return;
  TALLY_DISPATCH("fill_", *this, ALL, kk::fill<T>(numel(), static_cast<T>(value), data<T>()));
}

// ---- autograd plumbing ------------------------------------------------------------------------
Tensor& Tensor::set_requires_grad(bool on) {
  if (on && !is_floating(dtype()))
    throw ShapeError(fmt::format("set_requires_grad: only floating tensors can require grad, found {}", str()));
  if (!is_leaf()) throw Error(fmt::format("set_requires_grad: {} is not a leaf", str()));
  impl().requires_grad = on;
  return *this;
}

void Tensor::allocate_grad() {
  if (!impl().grad) {
    Tensor g = zeros(shape(), dtype(), device(), Category::gradient, "grad");
    impl().grad = g.impl_ptr();
  }
}

Tensor Tensor::grad() const { return impl().grad ? Tensor(impl().grad) : Tensor(); }

void Tensor::zero_grad() {
  if (impl().grad) Tensor(impl().grad).zero_();
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>(*impl_);
  impl->grad_fn.reset();
  impl->grad.reset();
  impl->requires_grad = false;
  return Tensor(std::move(impl));
}

void Tensor::backward() const { run_backward(*this); }

// ---- checks -----------------------------------------------------------------------------------
namespace detail {
void no_kernel(const char* op, const Tensor& t, std::initializer_list<DType> takes) {
  std::vector<const char*> names;
  for (DType d : takes) names.push_back(dtype_name(d));
  throw ShapeError(fmt::format("{}: no kernel for {} (on {} it takes {})", op, t.str(),
                               t.device().is_cpu() ? "the cpu" : "a GPU", fmt::join(names, " or ")));
}
void no_backend(const char* op, const Tensor& t) {
  throw ShapeError(fmt::format("{}: {} is on a GPU but this build of tally has no CUDA backend", op, t.str()));
}
}  // namespace detail

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  if (a.device() != b.device())
    throw ShapeError(fmt::format("{}: operands on different devices: {} and {}", op, a.str(), b.str()));
}
void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    throw ShapeError(fmt::format("{}: operands of different dtypes: {} and {}", op, a.str(), b.str()));
}
void check_same_shape(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, a, b);
  check_same_dtype(op, a, b);
  if (a.shape() != b.shape())
    throw ShapeError(fmt::format("{}: shapes differ: {} and {}", op, a.str(), b.str()));
}
void check_dim(const char* op, const char* what, const Tensor& t, std::int64_t dim) {
  if (!t.defined()) throw ShapeError(fmt::format("{}: {} is undefined", op, what));
  if (t.dim() != dim)
    throw ShapeError(fmt::format("{}: expected {} with {} dimensions, found {}", op, what, dim, t.str()));
}
void check_floating(const char* op, const Tensor& t) {
  if (t.dtype() != DType::Float32 && t.dtype() != DType::Float64 && t.dtype() != DType::BFloat16)
    throw ShapeError(fmt::format("{}: expected a float32, float64 or bfloat16 tensor, found {}", op, t.str()));
  if (t.dtype() == DType::Float64 && !t.device().is_cpu())
    throw ShapeError(fmt::format("{}: float64 is supported on the cpu only, found {}", op, t.str()));
}

void check_param(const char* op, const char* what, const Tensor& x, const Tensor& p) {
  check_same_device(op, x, p);
  const DType want = param_dtype(x.dtype());
  if (p.dtype() != want)
    throw ShapeError(fmt::format("{}: expected a {} {} for input {}, found {}{}", op, dtype_name(want), what, x.str(),
                                 p.str(),
                                 x.dtype() == DType::BFloat16
                                     ? " (bfloat16 activations take float32 parameters: the master weights)"
                                     : ""));
}

}  // namespace tally
