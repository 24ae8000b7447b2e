// Backend switching: the training step's matrix products on OpenBLAS (scipy-openblas32).
// Linked into the step's shared library, these functions are found by the Relax VM among the
// library's exports (R.call_dps_packed("pockengine_sgemm_nt", ...)): no Python in the loop.
//
// pockengine_sgemm_XY(a, b, c): c[i] = op_X(a[i]) @ op_Y(b[i]) for every leading index i
// (a, b, c of equal rank, 2 or 3, row-major, float32); op is the identity for n and the
// transpose of the last two axes for t.
//
// pockengine_sgemm_XY_bf16(a, b, c) and pockengine_sgemm_XY_i8(a, b, s, c), XY nn or nt: the
// same for 2-D operands, b a frozen weight stored as bfloat16, or as int8 with s the float32
// scales of its rows (transform/store_frozen_weights.py), widened to float32 one tile at a time
// into a buffer of the task's own that stays in cache, where OpenBLAS reads it: the weight is
// never written out whole as float32 and read back.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include <cblas.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/runtime/c_backend_api.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

namespace {

using tvm::ffi::TensorView;

const float* floats(const TensorView& t) {
  return reinterpret_cast<const float*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}

// One product, split by rows of the output over TVM's thread pool: each task calls OpenBLAS on
// one thread. OpenBLAS's own threads, beside TVM's spinning pool on the same cores, made the
// step several times slower and its time erratic.
struct Product {
  bool trans_a, trans_b;
  int64_t batch, m, n, k, lda, ldb;
  const float *a, *b;
  float* c;
};

int rows_task(int task, TVMParallelGroupEnv* env, void* data) {
  const Product& p = *static_cast<const Product*>(data);
  int64_t rows = p.batch * p.m, begin = rows * task / env->num_task,
          end = rows * (task + 1) / env->num_task;
  while (begin < end) {  // rows [begin, end) of the stacked outputs, one batch entry at a time
    int64_t i = begin / p.m, row = begin % p.m, count = std::min(end - begin, p.m - row);
    const float* a = p.a + i * p.m * p.k + (p.trans_a ? row : row * p.lda);
    scipy_cblas_sgemm(CblasRowMajor, p.trans_a ? CblasTrans : CblasNoTrans,
                      p.trans_b ? CblasTrans : CblasNoTrans, count, p.n, p.k, 1.0f, a, p.lda,
                      p.b + i * p.k * p.n, p.ldb, 0.0f, p.c + i * p.m * p.n + row * p.n, p.n);
    begin += count;
  }
  return 0;
}

void single_threaded_openblas() {
  static std::once_flag once;  // OpenBLAS would otherwise start a thread per CPU
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
}

void sgemm(bool trans_a, bool trans_b, TensorView a, TensorView b, TensorView c) {
  int nd = c.ndim();
  TVM_FFI_ICHECK(nd == 2 || nd == 3) << "pockengine_sgemm: rank " << nd << ", expected 2 or 3";
  TVM_FFI_ICHECK(a.ndim() == nd && b.ndim() == nd) << "pockengine_sgemm: operand ranks differ";
  TVM_FFI_ICHECK(a.IsContiguous() && b.IsContiguous() && c.IsContiguous())
      << "pockengine_sgemm: operands must be contiguous";
  single_threaded_openblas();
  Product p{trans_a, trans_b, nd == 3 ? c.size(0) : 1, c.size(nd - 2), c.size(nd - 1),
            trans_a ? a.size(nd - 2) : a.size(nd - 1), a.size(nd - 1), b.size(nd - 1),
            floats(a), floats(b), const_cast<float*>(floats(c))};
  TVMBackendParallelLaunch(rows_task, &p, 0);  // 0: as many tasks as the pool has threads
}

// The most of a weight widened at a time (4 MiB of float32 a task: measured faster here than
// tiles of 1 or 16 MiB; the cores share 32 MiB of L3).
constexpr int64_t kTileFloats = int64_t{1} << 20;
// The product's depth (its summed axis) widened at a time; each block's product is added into
// the output in order, so the sums do not depend on the number of tasks. A depth up to this is
// one block: the sums are those of one OpenBLAS call.
constexpr int64_t kDepthBlock = 1024;

template <typename Stored>
struct StoredProduct {
  bool trans_b;
  int64_t m, n, k;
  const float* a;
  const Stored* b;
  const float* scale;  // an int8 weight's, one per row of it; null for bfloat16
  float* c;
};

// A stored element as float32: a bfloat16 (its bits) is a float32's upper half; an int8 is its
// value (times its row's scale, below).
inline float as_float(uint16_t bits) {
  uint32_t wide = uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}
inline float as_float(int8_t value) { return static_cast<float>(value); }

// rows x cols of src (row stride ld; rows of the weight) into dst, contiguous; each row times
// its scale where there are scales: the float32 weight int8 values and scales stand for
template <typename Stored>
void widen(const Stored* src, int64_t rows, int64_t cols, int64_t ld, const float* scale,
           float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    if (scale) {
      for (int64_t j = 0; j < cols; ++j) dst[r * cols + j] = as_float(src[r * ld + j]) * scale[r];
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[r * cols + j] = as_float(src[r * ld + j]);
    }
  }
}

// The output's columns split evenly over the tasks; each task's a tile of the weight at a time:
// some of the output's columns by a block of the depth.
template <typename Stored>
int stored_columns_task(int task, TVMParallelGroupEnv* env, void* data) {
  const StoredProduct<Stored>& p = *static_cast<const StoredProduct<Stored>*>(data);
  int64_t begin = p.n * task / env->num_task, end = p.n * (task + 1) / env->num_task;
  if (begin == end) return 0;
  int64_t depth = std::min(p.k, kDepthBlock);
  int64_t tiles = ((end - begin) * depth + kTileFloats - 1) / kTileFloats;
  int64_t width = (end - begin + tiles - 1) / tiles;
  thread_local std::vector<float> tile;
  tile.resize(width * depth);
  for (int64_t j = begin; j < end; j += width) {
    int64_t cols = std::min(width, end - j);
    for (int64_t d = 0; d < p.k; d += depth) {
      int64_t rows = std::min(depth, p.k - d);
      if (p.trans_b)  // b is [n, k]: rows j.. of it, columns d..
        widen(p.b + j * p.k + d, cols, rows, p.k, p.scale ? p.scale + j : nullptr, tile.data());
      else  // b is [k, n]: rows d.., columns j..
        widen(p.b + d * p.n + j, rows, cols, p.n, p.scale ? p.scale + d : nullptr, tile.data());
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, p.trans_b ? CblasTrans : CblasNoTrans, p.m,
                        cols, rows, 1.0f, p.a + d, p.k, tile.data(), p.trans_b ? rows : cols,
                        d ? 1.0f : 0.0f, p.c + j, p.n);
    }
  }
  return 0;
}

template <typename Stored>
void sgemm_stored(bool trans_b, DLDataTypeCode code, int bits, const char* name, TensorView a,
                  TensorView b, const float* scale, TensorView c) {
  TVM_FFI_ICHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2)
      << name << ": operands must be 2-D";
  TVM_FFI_ICHECK(b.dtype().code == code && b.dtype().bits == bits)
      << name << ": the second operand's dtype is not the one stored";
  TVM_FFI_ICHECK(a.IsContiguous() && b.IsContiguous() && c.IsContiguous())
      << name << ": operands must be contiguous";
  single_threaded_openblas();
  StoredProduct<Stored> p{trans_b, c.size(0), c.size(1), a.size(1), floats(a),
                          reinterpret_cast<const Stored*>(static_cast<const char*>(b.data_ptr()) +
                                                          b.byte_offset()),
                          scale, const_cast<float*>(floats(c))};
  TVMBackendParallelLaunch(stored_columns_task<Stored>, &p, 0);
}

void sgemm_nn(TensorView a, TensorView b, TensorView c) { sgemm(false, false, a, b, c); }
void sgemm_nt(TensorView a, TensorView b, TensorView c) { sgemm(false, true, a, b, c); }
void sgemm_tn(TensorView a, TensorView b, TensorView c) { sgemm(true, false, a, b, c); }
void sgemm_tt(TensorView a, TensorView b, TensorView c) { sgemm(true, true, a, b, c); }
void sgemm_nn_bf16(TensorView a, TensorView b, TensorView c) {
  sgemm_stored<uint16_t>(false, kDLBfloat, 16, "pockengine_sgemm_nn_bf16", a, b, nullptr, c);
}
void sgemm_nt_bf16(TensorView a, TensorView b, TensorView c) {
  sgemm_stored<uint16_t>(true, kDLBfloat, 16, "pockengine_sgemm_nt_bf16", a, b, nullptr, c);
}
// s: the scales of b's rows as the weight (b is [k, n] for nn, [n, k] for nt), float32
const float* row_scales(const char* name, TensorView b, TensorView s) {
  TVM_FFI_ICHECK(s.ndim() == 1 && s.size(0) == b.size(0) && s.dtype().code == kDLFloat &&
                 s.dtype().bits == 32 && s.IsContiguous())
      << name << ": the scales must be float32, one per row of the weight";
  return floats(s);
}
void sgemm_nn_i8(TensorView a, TensorView b, TensorView s, TensorView c) {
  const char* name = "pockengine_sgemm_nn_i8";
  sgemm_stored<int8_t>(false, kDLInt, 8, name, a, b, row_scales(name, b, s), c);
}
void sgemm_nt_i8(TensorView a, TensorView b, TensorView s, TensorView c) {
  const char* name = "pockengine_sgemm_nt_i8";
  sgemm_stored<int8_t>(true, kDLInt, 8, name, a, b, row_scales(name, b, s), c);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nn, sgemm_nn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nt, sgemm_nt);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_tn, sgemm_tn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_tt, sgemm_tt);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nn_bf16, sgemm_nn_bf16);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nt_bf16, sgemm_nt_bf16);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nn_i8, sgemm_nn_i8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nt_i8, sgemm_nt_i8);
