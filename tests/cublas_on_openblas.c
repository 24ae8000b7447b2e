/* The part of cuBLAS's C API that pipelines/backend/cublas_sgemm.cc calls, computed on the
 * CPU by OpenBLAS's column-major sgemm, with cuBLAS's checks of the sizes: the shim opens this
 * library instead (POCKENGINE_CUBLAS) in a CPU build, so that its operand layout (which
 * operand, which transpose, which leading dimension and batch stride) is checked against
 * PyTorch on a machine without a GPU. Not shipped. */
#include <stddef.h>

#include <cblas.h>

enum { SUCCESS = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7 };

static int max1(int v) { return v > 1 ? v : 1; }

static int sizes_ok(int ta, int tb, int m, int n, int k, int lda, int ldb, int ldc) {
  return m >= 0 && n >= 0 && k >= 0 && (ta == 0 || ta == 1) && (tb == 0 || tb == 1) &&
         lda >= max1(ta ? k : m) && ldb >= max1(tb ? n : k) && ldc >= max1(m);
}

static int handles, workspaces;

int cublasCreate_v2(void** handle) { *handle = &handles; return SUCCESS; }
int cublasSetStream_v2(void* handle, void* stream) {
  (void)stream;
  workspaces = 0; /* as cuBLAS: a stream set resets the workspace */
  return handle == &handles ? SUCCESS : NOT_INITIALIZED;
}
int cublasSetWorkspace_v2(void* handle, void* workspace, size_t bytes) {
  workspaces = workspace != NULL && bytes > 0;
  return handle == &handles && workspaces ? SUCCESS : INVALID_VALUE;
}

int cublasSgemm_v2(void* handle, int ta, int tb, int m, int n, int k, const float* alpha,
                   const float* a, int lda, const float* b, int ldb, const float* beta, float* c,
                   int ldc) {
  if (handle != &handles || !workspaces) return NOT_INITIALIZED;
  if (!sizes_ok(ta, tb, m, n, k, lda, ldb, ldc)) return INVALID_VALUE;
  scipy_cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    m, n, k, *alpha, a, lda, b, ldb, *beta, c, ldc);
  return SUCCESS;
}

int cublasSgemmStridedBatched(void* handle, int ta, int tb, int m, int n, int k,
                              const float* alpha, const float* a, int lda, long long stride_a,
                              const float* b, int ldb, long long stride_b, const float* beta,
                              float* c, int ldc, long long stride_c, int batch) {
  if (batch < 0) return INVALID_VALUE;
  for (int i = 0; i < batch; ++i) {
    int status = cublasSgemm_v2(handle, ta, tb, m, n, k, alpha, a + i * stride_a, lda,
                                b + i * stride_b, ldb, beta, c + i * stride_c, ldc);
    if (status != SUCCESS) return status;
  }
  return SUCCESS;
}
