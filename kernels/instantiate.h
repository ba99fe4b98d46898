// kernels/instantiate.h — the explicit instantiations of kernels/backend.inc, one list per op
// family, written once for both backends.
//
// Each backend's file of a family ends with the list applied to the types it runs, inside its
// own namespace (where P<T> and the functions are its own), e.g. kernels/cpu/pool.cpp:
//   TALLY_INSTANTIATE_POOL(float) TALLY_INSTANTIATE_POOL(double) TALLY_INSTANTIATE_POOL(bf16)
// and kernels/cuda/pool.cu the same without double. A kernel added to the contract is added to
// its family's list here, and both backends instantiate it.
#pragma once

// gemm: T the operands, TC the output (T, or float for bf16 operands).
#define TALLY_INSTANTIATE_GEMM(T, TC)                                                                   \
  template void gemm<T, TC>(bool, bool, i64, i64, i64, P<T>, const T*, i64, const T*, i64, P<T>, TC*, i64, \
                            void*, std::size_t);

#define TALLY_INSTANTIATE_CONV(T)                                                                      \
  template std::size_t conv2d_workspace_bytes<T>(const Conv2dShape&, ConvPass);                        \
  template void conv2d_forward<T>(const Conv2dShape&, const T*, const P<T>*, const P<T>*, T*, void*);  \
  template void conv2d_backward_data<T>(const Conv2dShape&, const T*, const P<T>*, T*, P<T>, void*);   \
  template void conv2d_backward_filter<T>(const Conv2dShape&, const T*, const T*, P<T>*, P<T>, void*); \
  template void conv2d_backward_bias<T>(const Conv2dShape&, const T*, P<T>*, P<T>);

#define TALLY_INSTANTIATE_ELEMENTWISE(T)                                    \
  template void add<T>(i64, const T*, const T*, P<T>, T*);                  \
  template void axpby<T>(i64, P<T>, const T*, P<T>, T*);                    \
  template void mul<T>(i64, const T*, const T*, T*);                        \
  template void mul_backward<T>(i64, const T*, const T*, T*, P<T>);         \
  template void relu_forward<T>(i64, const T*, T*);                         \
  template void relu_backward<T>(i64, const T*, const T*, T*, P<T>);        \
  template void sigmoid_forward<T>(i64, const T*, T*);                      \
  template void sigmoid_backward<T>(i64, const T*, const T*, T*, P<T>);     \
  template void dropout_forward<T>(i64, i64, i64, bool, const DropoutKey&, const T*, T*); \
  template void dropout_backward<T>(i64, i64, i64, bool, const DropoutKey&, const T*, T*, P<T>); \
  template void scale_channels<T>(i64, i64, i64, bool, const T*, const T*, T*, P<T>); \
  template void scale_channels_backward_scale<T>(i64, i64, i64, bool, const T*, const T*, T*, P<T>); \
  template void copy_rows<T>(i64, i64, const T*, i64, T*, i64, P<T>);       \
  template void add_bias_rows<T>(i64, i64, const T*, const P<T>*, T*);      \
  template void sum_rows<T>(i64, i64, const T*, P<T>*, P<T>);               \
  template T sum_all<T>(i64, const T*);                                     \
  template void sum_to<T>(i64, const T*, P<T>, T*);                         \
  template void broadcast_scalar<T>(i64, const T*, P<T>, T*, P<T>);         \
  template void fill_product<T>(i64, const T*, const T*, T*);

// The memory-only functions: every dtype core/ moves (the ALL set of core/dispatch.h).
#define TALLY_INSTANTIATE_MEMORY(T)         \
  template void fill<T>(i64, T, T*);        \
  template void copy<T>(i64, const T*, T*); \
  template void strided_copy<T>(int, const i64*, const i64*, const T*, T*);

// From S to every floating storage type (core/dispatch.h's FLOAT_STORAGE set).
#define TALLY_INSTANTIATE_CONVERT(S)                        \
  template void convert<S, float>(i64, const S*, float*);   \
  template void convert<S, double>(i64, const S*, double*); \
  template void convert<S, bf16>(i64, const S*, bf16*);

#define TALLY_INSTANTIATE_NORM(T)                                                                              \
  template void batch_norm_forward_train<T>(i64, i64, i64, const T*, const P<T>*, const P<T>*, P<T>, P<T>,     \
                                            P<T>*, P<T>*, T*, P<T>*, P<T>*, void*, NormAct<T>);                \
  template void batch_norm_forward_eval<T>(i64, i64, i64, const T*, const P<T>*, const P<T>*, const P<T>*,     \
                                           const P<T>*, P<T>, T*);                                             \
  template void batch_norm_backward<T>(i64, i64, i64, const T*, const T*, const P<T>*, const P<T>*,           \
                                       const P<T>*, T*, P<T>, P<T>*, P<T>*, P<T>, void*, NormActGrad<T>);      \
  template void batch_norm_backward_eval<T>(i64, i64, i64, const T*, const T*, const P<T>*, const P<T>*,      \
                                            const P<T>*, P<T>, T*, P<T>, P<T>*, P<T>*, P<T>, void*);           \
  template void group_norm_forward<T>(i64, i64, i64, i64, const T*, const P<T>*, const P<T>*, P<T>, T*, P<T>*, \
                                      P<T>*, NormAct<T>);                                                      \
  template void group_norm_backward<T>(i64, i64, i64, i64, const T*, const T*, const P<T>*, const P<T>*,      \
                                       const P<T>*, T*, P<T>, P<T>*, P<T>*, P<T>, NormActGrad<T>);

// The moments touch statistics only: float32 (a bf16 norm's statistics are float32), and float64
// on the CPU.
#define TALLY_INSTANTIATE_MOMENTS(T)                                                                  \
  template void batch_norm_accumulate_moments<T>(i64, i64, T, const T*, const T*, double*, double*); \
  template void batch_norm_apply_moments<T>(i64, i64, T, const double*, const double*, T*, T*);

#define TALLY_INSTANTIATE_POOL(T)                                                                    \
  template void max_pool2d_forward<T>(const Pool2dShape&, const T*, T*, std::int32_t*);              \
  template void max_pool2d_backward<T>(const Pool2dShape&, const T*, const std::int32_t*, T*, P<T>); \
  template void avg_pool2d_forward<T>(const Pool2dShape&, bool, const T*, T*);                       \
  template void avg_pool2d_backward<T>(const Pool2dShape&, bool, const T*, T*, P<T>);                \
  template void adaptive_avg_pool2d_forward<T>(i64, i64, i64, i64, i64, i64, const T*, T*);          \
  template void adaptive_avg_pool2d_backward<T>(i64, i64, i64, i64, i64, i64, const T*, T*, P<T>);

#define TALLY_INSTANTIATE_LOSS(T)                                                                        \
  template i64 cross_entropy_forward<T>(i64, i64, const T*, const i64*, const T*, i64, T, T*, T*, bool); \
  template void cross_entropy_reduce<T>(i64, const T*, const T*, T, T*, T*);                              \
  template void cross_entropy_backward<T>(i64, i64, const T*, const i64*, const T*, i64, T, const T*, T*, T);

#define TALLY_INSTANTIATE_OPTIM(T)                                                              \
  template void sgd_update<T>(i64, T*, const T*, T*, T, T, T, T, bool, bool); \
  template void adamw_update<T>(i64, T*, const T*, T*, T*, T, T, T, T, T, i64);
