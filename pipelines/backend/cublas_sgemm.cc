// Backend switching on a GPU: the training step's float32 matrix products on cuBLAS.
// Linked into the step's shared library, these functions are found by the Relax VM among the
// library's exports (R.call_dps_packed("pockengine_cublas_sgemm_nt", ...)); TVM's
// RewriteCUDAGraph captures them into the step's CUDA graphs like its own kernels.
//
// pockengine_cublas_sgemm_XY(a, b, c): c[i] = op_X(a[i]) @ op_Y(b[i]) for every leading index
// i (a, b, c of equal rank, 2 or 3, row-major, float32, in GPU memory); op is the identity for
// n and the transpose of the last two axes for t.
//
// cuBLAS is opened at the first call (dlopen), not linked: the step library builds on a machine
// without it, and the GPU host's copy (PyTorch's, on LD_LIBRARY_PATH) is the one used. Its C
// API is declared here; POCKENGINE_CUBLAS names another library with the same API (the tests
// use one over OpenBLAS to check the operands' layout on a CPU).
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/c_backend_api.h>

namespace {

using tvm::ffi::TensorView;

// cuBLAS's v2 C API, the part used here (cublas_api.h)
using Handle = void*;
using Status = int;  // CUBLAS_STATUS_SUCCESS is 0
enum Operation { kOpN = 0, kOpT = 1 };
using Create = Status (*)(Handle*);
using SetStream = Status (*)(Handle, void*);
using SetWorkspace = Status (*)(Handle, void*, size_t);
using Sgemm = Status (*)(Handle, int, int, int, int, int, const float*, const float*, int,
                         const float*, int, const float*, float*, int);
using SgemmStridedBatched = Status (*)(Handle, int, int, int, int, int, const float*,
                                       const float*, int, long long, const float*, int,
                                       long long, const float*, float*, int, long long, int);

// NVIDIA's recommended workspace for Hopper. The step's own: cuBLAS's default pool may allocate
// on a stream that is being captured into a CUDA graph, which capture forbids.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

struct Library {
  Create create;
  SetStream set_stream;
  SetWorkspace set_workspace;
  Sgemm sgemm;
  SgemmStridedBatched sgemm_strided_batched;
};

const Library& library() {
  static const Library lib = [] {
    const char* name = std::getenv("POCKENGINE_CUBLAS");
    name = name && *name ? name : "libcublas.so.13";
    void* so = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    TVM_FFI_ICHECK(so) << "pockengine_cublas_sgemm: cannot open " << name << " (" << dlerror()
                       << "): put the directory of NVIDIA's cuBLAS 13 (e.g. PyTorch's "
                       << "nvidia/cu13/lib) on LD_LIBRARY_PATH";
    auto symbol = [&](const char* sym) {
      void* found = dlsym(so, sym);
      TVM_FFI_ICHECK(found) << "pockengine_cublas_sgemm: " << name << " lacks " << sym;
      return found;
    };
    return Library{reinterpret_cast<Create>(symbol("cublasCreate_v2")),
                   reinterpret_cast<SetStream>(symbol("cublasSetStream_v2")),
                   reinterpret_cast<SetWorkspace>(symbol("cublasSetWorkspace_v2")),
                   reinterpret_cast<Sgemm>(symbol("cublasSgemm_v2")),
                   reinterpret_cast<SgemmStridedBatched>(symbol("cublasSgemmStridedBatched"))};
  }();
  return lib;
}

void check(Status status, const char* call) {
  TVM_FFI_ICHECK(status == 0) << "pockengine_cublas_sgemm: " << call << " returned cuBLAS status "
                              << status;
}

// One handle and workspace per thread and device, made at the first call: TVM runs a captured
// region once uncaptured before capturing it, so they are never made during a capture.
struct Context {
  int32_t device_type = -1, device_id = -1;
  Handle handle = nullptr;
  void* workspace = nullptr;
};

Handle handle_for(DLDevice device) {
  thread_local Context context;
  const Library& lib = library();
  if (context.device_type != device.device_type || context.device_id != device.device_id) {
    TVM_FFI_ICHECK(context.handle == nullptr)
        << "pockengine_cublas_sgemm: one thread, one device (had " << context.device_id
        << ", now " << device.device_id << ")";
    check(lib.create(&context.handle), "cublasCreate");
    context.workspace = TVMBackendAllocWorkspace(device.device_type, device.device_id,
                                                 kWorkspaceBytes, kDLUInt, 8);
    TVM_FFI_ICHECK(context.workspace) << "pockengine_cublas_sgemm: no workspace";
    context.device_type = device.device_type;
    context.device_id = device.device_id;
  }
  // TVM's current stream: the capture stream while a CUDA graph is captured. Setting a stream
  // resets cuBLAS's workspace to its pool, so the step's is set again after it.
  check(lib.set_stream(context.handle, TVMFFIEnvGetStream(device.device_type, device.device_id)),
        "cublasSetStream");
  check(lib.set_workspace(context.handle, context.workspace, kWorkspaceBytes),
        "cublasSetWorkspace");
  return context.handle;
}

const float* floats(const TensorView& t) {
  return reinterpret_cast<const float*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}

int narrow(int64_t value, const char* what) {
  TVM_FFI_ICHECK(value <= INT32_MAX) << "pockengine_cublas_sgemm: " << what << " " << value
                                     << " exceeds cuBLAS's 32-bit sizes";
  return static_cast<int>(value);
}

// cuBLAS is column-major, and a row-major matrix is its transpose there: c = op(a) @ op(b) is
// computed as c^T = op(b)^T @ op(a)^T, the operands swapped, each read with its own row length
// as leading dimension.
void sgemm(bool trans_a, bool trans_b, TensorView a, TensorView b, TensorView c) {
  int nd = c.ndim();
  TVM_FFI_ICHECK(nd == 2 || nd == 3) << "pockengine_cublas_sgemm: rank " << nd
                                     << ", expected 2 or 3";
  TVM_FFI_ICHECK(a.ndim() == nd && b.ndim() == nd)
      << "pockengine_cublas_sgemm: operand ranks differ";
  TVM_FFI_ICHECK(a.IsContiguous() && b.IsContiguous() && c.IsContiguous())
      << "pockengine_cublas_sgemm: operands must be contiguous";
  int64_t batch = nd == 3 ? c.size(0) : 1, m = c.size(nd - 2), n = c.size(nd - 1);
  int64_t k = trans_a ? a.size(nd - 2) : a.size(nd - 1);
  int lda = narrow(a.size(nd - 1), "a's rows"), ldb = narrow(b.size(nd - 1), "b's rows");
  const Library& lib = library();
  Handle handle = handle_for(c.device());
  const float one = 1.0f, zero = 0.0f;
  int op_a = trans_a ? kOpT : kOpN, op_b = trans_b ? kOpT : kOpN;
  float* out = const_cast<float*>(floats(c));
  if (batch == 1) {
    check(lib.sgemm(handle, op_b, op_a, narrow(n, "n"), narrow(m, "m"), narrow(k, "k"), &one,
                    floats(b), ldb, floats(a), lda, &zero, out, narrow(n, "n")),
          "cublasSgemm");
  } else {
    check(lib.sgemm_strided_batched(handle, op_b, op_a, narrow(n, "n"), narrow(m, "m"),
                                    narrow(k, "k"), &one, floats(b), ldb, k * n, floats(a), lda,
                                    m * k, &zero, out, narrow(n, "n"), m * n,
                                    narrow(batch, "batch")),
          "cublasSgemmStridedBatched");
  }
}

void sgemm_nn(TensorView a, TensorView b, TensorView c) { sgemm(false, false, a, b, c); }
void sgemm_nt(TensorView a, TensorView b, TensorView c) { sgemm(false, true, a, b, c); }
void sgemm_tn(TensorView a, TensorView b, TensorView c) { sgemm(true, false, a, b, c); }
void sgemm_tt(TensorView a, TensorView b, TensorView c) { sgemm(true, true, a, b, c); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_cublas_sgemm_nn, sgemm_nn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_cublas_sgemm_nt, sgemm_nt);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_cublas_sgemm_tn, sgemm_tn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pockengine_cublas_sgemm_tt, sgemm_tt);
