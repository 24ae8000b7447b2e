// Backend switching: the training step's matrix products on OpenBLAS (scipy-openblas32).
// Linked into the step's shared library, these functions are found by the Relax VM among the
// library's exports (R.call_dps_packed("pockengine_sgemm_nt", ...)): no Python in the loop.
//
// pockengine_sgemm_XY(a, b, c): c[i] = op_X(a[i]) @ op_Y(b[i]) for every leading index i
// (a, b, c of equal rank, 2 or 3, row-major, float32); op is the identity for n and the
// transpose of the last two axes for t.
#include <algorithm>
#include <mutex>

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

void sgemm(bool trans_a, bool trans_b, TensorView a, TensorView b, TensorView c) {
  int nd = c.ndim();
  TVM_FFI_ICHECK(nd == 2 || nd == 3) << "pockengine_sgemm: rank " << nd << ", expected 2 or 3";
  TVM_FFI_ICHECK(a.ndim() == nd && b.ndim() == nd) << "pockengine_sgemm: operand ranks differ";
  TVM_FFI_ICHECK(a.IsContiguous() && b.IsContiguous() && c.IsContiguous())
      << "pockengine_sgemm: operands must be contiguous";
  static std::once_flag once;  // OpenBLAS would otherwise start a thread per CPU
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
  Product p{trans_a, trans_b, nd == 3 ? c.size(0) : 1, c.size(nd - 2), c.size(nd - 1),
            trans_a ? a.size(nd - 2) : a.size(nd - 1), a.size(nd - 1), b.size(nd - 1),
            floats(a), floats(b), const_cast<float*>(floats(c))};
  TVMBackendParallelLaunch(rows_task, &p, 0);  // 0: as many tasks as the pool has threads
}

void sgemm_nn(TensorView a, TensorView b, TensorView c) { sgemm(false, false, a, b, c); }
void sgemm_nt(TensorView a, TensorView b, TensorView c) { sgemm(false, true, a, b, c); }
void sgemm_tn(TensorView a, TensorView b, TensorView c) { sgemm(true, false, a, b, c); }
void sgemm_tt(TensorView a, TensorView b, TensorView c) { sgemm(true, true, a, b, c); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nn, sgemm_nn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_nt, sgemm_nt);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_tn, sgemm_tn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_sgemm_tt, sgemm_tt);
