// tests/gpu_buffer.h — exact-size device buffers for the kernel tests (gpu_kernels_test.cpp,
// gpu_bf16_test.cpp); a build with the CUDA backend only.
//
// Device buffers are cudaMalloc allocations of exactly their size (class Buf), not arena blocks,
// so that compute-sanitizer's memcheck (scripts/gpu-check.sh) knows each buffer's true bounds and
// reports any access a kernel makes past them; inside the arena such an access would land in a
// neighbour unseen. Transfers go through the compute stream, in order with the kernels.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/context.h"

namespace tally::test {

template <class T>
class Buf {
 public:
  explicit Buf(std::size_t n = 0) : n_(n) {
    if (n) TALLY_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
  }
  explicit Buf(const std::vector<T>& v) : Buf(v.size()) {
    if (n_) {
      TALLY_CUDA_CHECK(cudaMemcpyAsync(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice,
                                       kernels::cuda::compute_stream()));
      kernels::cuda::synchronize();
    }
  }
  ~Buf() {
    if (p_) (void)cudaFree(p_);  // synchronizes: no kernel still uses it
  }
  Buf(Buf&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> v(n_);
    if (n_) {
      TALLY_CUDA_CHECK(cudaMemcpyAsync(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost,
                                       kernels::cuda::compute_stream()));
      kernels::cuda::synchronize();
    }
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

template <class T>
Buf<T> dev(const std::vector<T>& v) { return Buf<T>(v); }
template <class T>
std::vector<T> host(const Buf<T>& b) { return b.host(); }
template <class T>
T* P(const Buf<T>& b) { return b.get(); }
// Device scratch of `bytes` (null for 0), standing in for the arena block core/ would carve.
inline Buf<unsigned char> scratch(std::size_t bytes) { return Buf<unsigned char>(bytes); }
inline void* ws_ptr(const Buf<unsigned char>& b) { return b.get(); }

}  // namespace tally::test
