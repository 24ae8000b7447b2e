// pockengine's native training runner: fine-tunes with a built step (step.so) using TVM's
// runtime library only, no Python. Built per device by pipelines/runtime/native.py.
//
//   runner STEP_DIR --data DIR --out DIR [--epochs 1] [--steps N] [--seed 0] [--state FILE]
//          [--profile]
//
// STEP_DIR holds step.so, runner.json (the step's device, data inputs, state and updates:
// written by native.py) and state.safetensors (the weights it starts from, the optimizer state
// at zero). A step built for an NVIDIA GPU runs there: its state stays in GPU memory, updated in
// place, and only a batch goes up and a loss comes back per step; libtvm_runtime_cuda.so beside
// the runner loads the CUDA runtime (libcudart.so.13, through LD_LIBRARY_PATH or ldconfig).
// DIR/train.safetensors holds one tensor per data input of the step, named as runner.json
// says, with N examples on the first axis. Each epoch runs the batches of a seeded shuffle (the
// last partial batch is dropped: the step has fixed shapes). OUT receives, each file complete
// or not at all: weights.safetensors (parameters and buffers under the source model's names),
// state.safetensors (the whole state under the step's names: --state resumes from it) and
// log.json (losses, batch order, step times, peak resident memory; on a GPU the device memory
// the run held above its start). With --profile, every call the VM makes (each kernel and each of
// its own builtins) is timed here in C++, and log.json's "calls" lists one step's calls in
// order, each with its median seconds over the steps after the first and, for a matrix
// product, its floating-point operations.
//
// Exit codes: 0 done; 2 bad input (the message names the file, the tensor and what is allowed);
// 3 a step's loss or new state is not finite (OUT keeps the state of the last finished epoch);
// 1 anything else.
#include <dlfcn.h>
#include <dlpack/dlpack.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;
namespace json = tvm::ffi::json;

namespace {

constexpr int kBadInput = 2, kNotFinite = 3;

struct Failure : std::runtime_error {  // an error that ends the run with ``code``
  int code;
  Failure(int code, const std::string& message) : std::runtime_error(message), code(code) {}
};

[[noreturn]] void bad_input(const std::string& message) { throw Failure(kBadInput, message); }

// Host tensors aligned as TVM's kernels expect (its kAllocAlignment is 64).
struct AlignedAlloc {
  void AllocData(DLTensor* t) {
    size_t bytes = 1;
    for (int i = 0; i < t->ndim; ++i) bytes *= t->shape[i];
    bytes *= (t->dtype.bits * t->dtype.lanes + 7) / 8;
    t->data = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (t->data == nullptr) throw std::bad_alloc();
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

const DLDevice kCPU{kDLCPU, 0};

size_t bytes_of(const ffi::Tensor& t) {
  return t.numel() * ((t.dtype().bits * t.dtype().lanes + 7) / 8);
}

char* data_of(const ffi::Tensor& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

ffi::Tensor empty(const std::vector<int64_t>& shape, DLDataType dtype) {
  return ffi::Tensor::FromNDAlloc(AlignedAlloc(), ffi::ShapeView(shape.data(), shape.size()),
                                  dtype, kCPU);
}

// The step's device. Its tensors are made and copied through TVM's runtime, the same calls on
// every device; loading the CUDA runtime and reading free memory are a GPU's own.
class Device {
 public:
  explicit Device(const std::string& kind) {
    if (kind == "cuda") {
      // TVM's CUDA runtime registers the device when it loads; it is beside the runner
      char exe[4096];
      ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
      std::string dir = n > 0 ? std::string(exe, n) : ".";
      std::string library = dir.substr(0, dir.rfind('/')) + "/libtvm_runtime_cuda.so";
      if (!dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL))
        throw std::runtime_error(std::string("the step is built for an NVIDIA GPU, and TVM's CUDA "
                                             "runtime does not load: ") + dlerror() +
                                 " (put the CUDA runtime's directory on LD_LIBRARY_PATH)");
      device_ = {kDLCUDA, 0};
    } else if (kind != "cpu") {
      bad_input("runner.json: device '" + kind + "'; allowed: cpu, cuda");
    }
    alloc_ = ffi::Function::GetGlobalRequired("runtime.TVMTensorAllocWithScope");
    from_bytes_ = ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromBytes");
    to_bytes_ = ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyToBytes");
    copy_ = ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromTo");
    attribute_ = ffi::Function::GetGlobalRequired("runtime.GetDeviceAttr");
  }
  DLDevice dl() const { return device_; }
  bool on_host() const { return device_.device_type == kDLCPU; }

  ffi::Tensor empty(const std::vector<int64_t>& shape, DLDataType dtype) const {
    return alloc_(ffi::Shape(shape), dtype, device_, nullptr).cast<ffi::Tensor>();
  }
  ffi::Tensor upload(const void* data, const std::vector<int64_t>& shape, DLDataType dtype) const {
    ffi::Tensor t = empty(shape, dtype);
    write(t, data);
    return t;
  }
  void write(const ffi::Tensor& t, const void* data) const {
    from_bytes_(t, const_cast<void*>(data), static_cast<int64_t>(bytes_of(t)));
  }
  void read(const ffi::Tensor& t, void* into) const {
    to_bytes_(t, into, static_cast<int64_t>(bytes_of(t)));
  }
  void copy(const ffi::Tensor& from, const ffi::Tensor& to) const { copy_(from, to); }
  // ``t`` readable here: itself on the CPU, else a copy
  ffi::Tensor on_host_copy(const ffi::Tensor& t) const {
    if (on_host()) return t;
    ffi::Tensor host = ::empty(std::vector<int64_t>(t.shape().begin(), t.shape().end()), t.dtype());
    read(t, data_of(host));
    return host;
  }
  // the GPU's free memory (the driver's count), or -1 on the CPU
  long long free_bytes() const {
    if (on_host()) return -1;
    constexpr int kAvailableGlobalMemory = 15;  // TVM's DeviceAttrKind
    ffi::Any free = attribute_(static_cast<int>(device_.device_type), device_.device_id,
                               kAvailableGlobalMemory);
    auto bytes = free.as<int64_t>();
    return bytes ? *bytes : -1;
  }

 private:
  DLDevice device_ = kCPU;
  ffi::Function alloc_, from_bytes_, to_bytes_, copy_, attribute_;
};

// safetensors' dtype names and DLPack's
const std::map<std::string, DLDataType> kDTypes = {
    {"F32", {kDLFloat, 32, 1}}, {"F64", {kDLFloat, 64, 1}}, {"F16", {kDLFloat, 16, 1}},
    {"BF16", {kDLBfloat, 16, 1}}, {"I64", {kDLInt, 64, 1}}, {"I32", {kDLInt, 32, 1}},
    {"I16", {kDLInt, 16, 1}}, {"I8", {kDLInt, 8, 1}}, {"U8", {kDLUInt, 8, 1}},
    {"BOOL", {kDLBool, 8, 1}}};

std::string safetensors_dtype(DLDataType dtype) {
  for (const auto& [name, t] : kDTypes)
    if (t.code == dtype.code && t.bits == dtype.bits && t.lanes == dtype.lanes) return name;
  throw std::runtime_error("no safetensors dtype for " + std::string(ffi::DLDataTypeToString(dtype)));
}

std::string shape_text(const std::vector<int64_t>& shape, const std::string& first = "") {
  std::string text = "[" + first;
  for (size_t i = 0; i < shape.size(); ++i)
    text += (i || !first.empty() ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad_input(path + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

json::Value parse_json(const std::string& text, const std::string& path) {
  ffi::String error;
  json::Value value = json::Parse(text, &error);
  if (!error.empty()) bad_input(path + ": not valid JSON (" + std::string(error) + ")");
  return value;
}

// A safetensors file mapped read-only: its tensors' dtype, shape and bytes.
class SafeTensors {
 public:
  struct Entry {
    DLDataType dtype;
    std::vector<int64_t> shape;
    const char* data;
    size_t bytes;
  };

  explicit SafeTensors(const std::string& path) : path_(path) {
    int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) bad_input(path + ": not found");
    struct stat st;
    fstat(fd, &st);
    size_ = st.st_size;
    base_ = size_ ? mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    close(fd);
    uint64_t header = 0;
    if (base_ == MAP_FAILED || size_ < 8 ||
        (std::memcpy(&header, base_, 8), header > size_ - 8))
      bad_input(path + ": not a safetensors file");
    const char* bytes = static_cast<const char*>(base_);
    json::Object entries = parse_json(std::string(bytes + 8, header), path).cast<json::Object>();
    for (const auto& [key, value] : entries) {
      std::string name(key.cast<ffi::String>());
      if (name == "__metadata__") continue;
      json::Object info = value.cast<json::Object>();
      std::string dtype(info["dtype"].cast<ffi::String>());
      if (!kDTypes.count(dtype)) bad_input(path + ": tensor '" + name + "' has dtype " + dtype);
      Entry entry{kDTypes.at(dtype), {}, nullptr, 0};
      for (const auto& d : info["shape"].cast<json::Array>()) entry.shape.push_back(d.cast<int64_t>());
      json::Array offsets = info["data_offsets"].cast<json::Array>();
      size_t begin = offsets[0].cast<int64_t>(), end = offsets[1].cast<int64_t>();
      if (end < begin || 8 + header + end > size_) bad_input(path + ": tensor '" + name + "' lies past the end");
      entry.data = bytes + 8 + header + begin;
      entry.bytes = end - begin;
      entries_[name] = entry;
    }
  }
  ~SafeTensors() {
    if (base_ != MAP_FAILED) munmap(base_, size_);
  }
  SafeTensors(const SafeTensors&) = delete;
  SafeTensors& operator=(const SafeTensors&) = delete;

  const Entry& get(const std::string& name, const std::string& wanted) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) bad_input(path_ + ": no tensor '" + name + "'; needs " + wanted);
    return it->second;
  }
  const std::string& path() const { return path_; }
  // Drops the pages of an entry already copied out: the mapping is private and read-only, so
  // they are clean (read again from the file if touched) and need not stay resident.
  void release(const Entry& entry) const {
    const uintptr_t page = sysconf(_SC_PAGESIZE), start = reinterpret_cast<uintptr_t>(entry.data);
    const uintptr_t begin = (start + page - 1) / page * page, end = (start + entry.bytes) / page * page;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

 private:
  std::string path_;
  void* base_ = MAP_FAILED;
  size_t size_ = 0;
  std::map<std::string, Entry> entries_;
};

// Writes ``path`` through a temporary file beside it, renamed over it when complete.
void write_atomic(const std::string& path, const std::string& head,
                  const std::vector<std::pair<const void*, size_t>>& chunks = {}) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(head.data(), head.size());
    for (const auto& [data, bytes] : chunks) out.write(static_cast<const char*>(data), bytes);
    if (!out) throw std::runtime_error(tmp + ": cannot be written");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error(path + ": cannot be written");
}

std::string json_string(const std::string& s) {
  return std::string(json::Stringify(ffi::String(s)));
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, ffi::Tensor>>& tensors) {
  std::vector<std::pair<std::string, ffi::Tensor>> sorted = tensors;
  std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.first < b.first; });
  std::string header = "{";
  std::vector<std::pair<const void*, size_t>> chunks;
  size_t offset = 0;
  for (const auto& [name, t] : sorted) {
    size_t bytes = bytes_of(t);
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    header += (chunks.empty() ? "" : ",") + json_string(name) + ":{\"dtype\":\"" +
              safetensors_dtype(t.dtype()) + "\",\"shape\":" + shape_text(shape) +
              ",\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + bytes) + "]}";
    chunks.emplace_back(data_of(t), bytes);
    offset += bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  uint64_t size = header.size();
  write_atomic(path, std::string(reinterpret_cast<const char*>(&size), 8) + header, chunks);
}

struct DataInput {  // one of the step's data inputs, and where its examples come from
  std::string name;
  DLDataType dtype;
  std::vector<int64_t> shape;    // the step's
  std::vector<int64_t> example;  // one example's, as the data holds it: [N, *example]
  int64_t rows = -1;             // the rows of the table its values index (-1: none)
  const SafeTensors::Entry* examples = nullptr;
  size_t example_bytes = 0;
  ffi::Tensor batch;      // allocated once, refilled every step
  ffi::Tensor on_device;  // what the step takes: the batch itself, or its copy on the GPU
};

template <typename T>
bool all_finite(const void* data, size_t count) {
  const T* values = static_cast<const T*>(data);
  for (size_t i = 0; i < count; ++i)
    if (!std::isfinite(values[i])) return false;
  return true;
}

bool finite(const ffi::Tensor& t) {
  if (t.dtype().code != kDLFloat) return true;
  if (t.dtype().bits == 32) return all_finite<float>(data_of(t), t.numel());
  if (t.dtype().bits == 64) return all_finite<double>(data_of(t), t.numel());
  return true;
}

// The data's labels the loss can score: 0 <= y < classes, or the ignore index.
void check_labels(const DataInput& input, int64_t classes, int64_t ignore, const std::string& file) {
  size_t count = input.examples->bytes / (input.dtype.bits / 8);
  for (size_t i = 0; i < count; ++i) {
    int64_t y = input.dtype.bits == 64 ? reinterpret_cast<const int64_t*>(input.examples->data)[i]
                                       : reinterpret_cast<const int32_t*>(input.examples->data)[i];
    if (y != ignore && (y < 0 || y >= classes))
      bad_input(file + ": labels [" + std::to_string(y) + "] are out of range; allowed: 0 to " +
                std::to_string(classes - 1) + " (the model's " + std::to_string(classes) +
                " classes), or " + std::to_string(ignore) + " (scores nothing)");
  }
}

// An input whose values index a table (token ids): 0 <= value < its rows. The step's take
// reads past the table unchecked.
void check_indices(const DataInput& input, const std::string& file) {
  size_t count = input.examples->bytes / (input.dtype.bits / 8);
  for (size_t i = 0; i < count; ++i) {
    int64_t v = input.dtype.bits == 64 ? reinterpret_cast<const int64_t*>(input.examples->data)[i]
                                       : reinterpret_cast<const int32_t*>(input.examples->data)[i];
    if (v < 0 || v >= input.rows)
      bad_input(file + ": input '" + input.name + "' holds [" + std::to_string(v) +
                "], past the table it indexes; allowed: 0 to " + std::to_string(input.rows - 1) +
                " (its " + std::to_string(input.rows) + " rows: for token ids, the model's "
                "vocabulary)");
  }
}

// The peak resident memory of this program (VmHWM: unlike getrusage's ru_maxrss, not the
// peak of the process it was forked from), in bytes.
long long peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;  // in kB
  return -1;
}

uint64_t splitmix64(uint64_t& x) {  // the shuffle's generator: small and the same everywhere
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct Args {
  std::string step_dir, data_dir, out_dir, state;
  long long epochs = 1, steps = -1, seed = 0;
  bool profile = false;
};

// The floating-point operations of a call to a matrix product (a generated ``gemm_<XY>``
// kernel or the shims' ``pockengine_sgemm_<XY>...`` and ``pockengine_cublas_sgemm_<XY>...``:
// its symbol holds "gemm"), read from its operands, c = op(a) @ op(b) over equal leading axes,
// a first and c last (kernels/gemm.py): a holds batch x m x k elements whichever way it is
// read, so the product's 2 x batch x m x n x k is 2 x |a| x (c's last axis). 0 for any other call.
double product_flops(const std::string& symbol, ffi::PackedArgs args) {
  if (symbol.find("gemm") == std::string::npos || args.size() < 7) return 0;  // 4 + a, b, c
  auto a = args[4].as<ffi::Tensor>(), c = args[args.size() - 1].as<ffi::Tensor>();
  if (!a || !c || c->ndim() == 0) return 0;
  return 2.0 * static_cast<double>(a->numel()) * static_cast<double>(c->size(c->ndim() - 1));
}

// Each VM call of a step timed, through the VM's instrument (called before and after each
// call): a C++ callback, so the timing costs tens of nanoseconds, not a Python call's
// microseconds. A step's calls are the same every step (the VM program has no branches); each
// position's median over the steps after the first is reported (a busy machine's outliers
// would dominate a mean).
class CallProfile {
 public:
  void start_step(bool counted) {
    counted_ = counted;
    position_ = 0;
  }
  ffi::Function instrument() {
    return ffi::Function::FromPacked([this](ffi::PackedArgs args, ffi::Any* rv) {
      auto now = std::chrono::steady_clock::now();
      if (args[2].cast<bool>()) {  // before the call
        started_ = now;
      } else if (counted_) {
        double seconds = std::chrono::duration<double>(now - started_).count();
        std::string symbol(args[1].cast<ffi::String>());
        if (position_ == calls_.size()) calls_.push_back({symbol, product_flops(symbol, args), {}});
        else if (calls_[position_].symbol != symbol)
          throw std::runtime_error("--profile: call " + std::to_string(position_ + 1) + " was " +
                                   calls_[position_].symbol + ", now " + symbol);
        calls_[position_++].seconds.push_back(seconds);
      }
      *rv = 0;  // go on as usual
    });
  }
  std::string json() {
    std::ostringstream text;
    text << "[";
    for (size_t i = 0; i < calls_.size(); ++i) {
      auto& times = calls_[i].seconds;
      std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
      text << (i ? ",\n  " : "") << "[\"" << calls_[i].symbol << "\", "
           << times[times.size() / 2] << ", " << calls_[i].flops << "]";
    }
    return text.str() + "]";
  }

 private:
  struct Call {
    std::string symbol;
    double flops;
    std::vector<double> seconds;
  };
  std::vector<Call> calls_;
  std::chrono::steady_clock::time_point started_;
  size_t position_ = 0;
  bool counted_ = false;
};

Args parse_args(int argc, char** argv) {
  const std::string usage =
      "usage: runner STEP_DIR --data DIR --out DIR [--epochs 1] [--steps N] [--seed 0] "
      "[--state FILE] [--profile]";
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::puts(usage.c_str());
      std::exit(0);
    }
    if (flag.rfind("--", 0) != 0) {
      args.step_dir = flag;
      continue;
    }
    if (flag == "--profile") {
      args.profile = true;
      continue;
    }
    if (i + 1 >= argc) bad_input(flag + " needs a value; " + usage);
    std::string value = argv[++i];
    char* end = nullptr;
    if (flag == "--data") args.data_dir = value;
    else if (flag == "--out") args.out_dir = value;
    else if (flag == "--state") args.state = value;
    else if (flag == "--epochs" || flag == "--steps" || flag == "--seed") {
      long long number = std::strtoll(value.c_str(), &end, 10);
      if (*end || number < (flag == "--seed" ? 0 : 1))
        bad_input(flag + " " + value + ": allowed: an integer >= " + (flag == "--seed" ? "0" : "1"));
      (flag == "--epochs" ? args.epochs : flag == "--steps" ? args.steps : args.seed) = number;
    } else bad_input("unknown option " + flag + "; " + usage);
  }
  if (args.step_dir.empty() || args.data_dir.empty() || args.out_dir.empty()) bad_input(usage);
  if (args.state.empty()) args.state = args.step_dir + "/state.safetensors";
  return args;
}

int run(const Args& args) {
  const std::string manifest_path = args.step_dir + "/runner.json";
  json::Object manifest = parse_json(read_text(manifest_path), manifest_path).cast<json::Object>();
  struct stat out_stat;
  if (stat(args.out_dir.c_str(), &out_stat) != 0 || !S_ISDIR(out_stat.st_mode))
    bad_input(args.out_dir + ": not a directory; give one to receive the weights");
  const Device device(manifest.count("device") ? std::string(manifest["device"].cast<ffi::String>())
                                               : "cpu");
  // a step replaying CUDA graphs reads its state from the tensors it captured on its first
  // call: a new value is copied into them, never put in their place
  const bool resident = manifest.count("resident") && manifest["resident"].cast<bool>();

  // The data: one tensor per data input, N examples each.
  const std::string train_path = args.data_dir + "/train.safetensors";
  SafeTensors train(train_path);
  std::vector<DataInput> inputs;
  std::string wanted;
  for (const auto& item : manifest["data"].cast<json::Array>()) {
    json::Object info = item.cast<json::Object>();
    DataInput input;
    input.name = info["name"].cast<ffi::String>();
    input.dtype = ffi::StringToDLDataType(info["dtype"].cast<ffi::String>());
    for (const auto& d : info["shape"].cast<json::Array>()) input.shape.push_back(d.cast<int64_t>());
    for (const auto& d : info["example"].cast<json::Array>()) input.example.push_back(d.cast<int64_t>());
    if (info.count("rows")) input.rows = info["rows"].cast<int64_t>();
    wanted += (wanted.empty() ? "" : " and ") + input.name + " " +
              std::string(ffi::DLDataTypeToString(input.dtype)) + " " +
              shape_text(input.example, "N");
    inputs.push_back(std::move(input));
  }
  int64_t examples = -1;
  for (auto& input : inputs) {
    input.examples = &train.get(input.name, wanted);
    const auto& e = *input.examples;
    bool same = e.dtype.code == input.dtype.code && e.dtype.bits == input.dtype.bits &&
                !e.shape.empty() &&
                std::vector<int64_t>(e.shape.begin() + 1, e.shape.end()) == input.example;
    if (!same || (examples >= 0 && e.shape[0] != examples))
      bad_input(train_path + ": tensor '" + input.name + "' is " +
                std::string(ffi::DLDataTypeToString(e.dtype)) + " " + shape_text(e.shape) +
                "; allowed: " + wanted + ", the same N for all");
    examples = e.shape[0];
    input.example_bytes = examples ? e.bytes / examples : 0;
    input.batch = empty(input.shape, input.dtype);
    input.on_device = device.on_host() ? input.batch : device.empty(input.shape, input.dtype);
  }
  const int64_t batch = manifest["batch"].cast<int64_t>();
  if (examples < batch)
    bad_input(train_path + ": " + std::to_string(examples) + " examples, fewer than one batch of " +
              std::to_string(batch));
  for (const auto& input : inputs) {
    if (input.rows >= 0 && input.dtype.code == kDLInt && input.dtype.bits >= 32)
      check_indices(input, train_path);
    if (input.dtype.code == kDLFloat && input.dtype.bits == 32) {
      const float* v = reinterpret_cast<const float*>(input.examples->data);
      size_t bad = 0, count = input.examples->bytes / 4;
      for (size_t i = 0; i < count; ++i) bad += !std::isfinite(v[i]);
      if (bad)
        bad_input(train_path + ": input '" + input.name + "' holds " + std::to_string(bad) +
                  " non-finite values (NaN or inf); allowed: finite numbers");
    }
  }
  if (manifest.count("labels") && manifest["labels"] != nullptr) {
    json::Object labels = manifest["labels"].cast<json::Object>();
    std::string name(labels["name"].cast<ffi::String>());
    for (const auto& input : inputs)
      if (input.name == name)
        check_labels(input, labels["classes"].cast<int64_t>(),
                     labels["ignore_index"].cast<int64_t>(), train_path);
  }

  // The state, in the step's order, each tensor a copy the step may update in place.
  device.empty({1}, DLDataType{kDLFloat, 32, 1});  // a GPU's context, before its memory is read
  const long long free_at_start = device.free_bytes();
  long long least_free = free_at_start;
  SafeTensors saved(args.state);
  std::vector<std::string> state_names;
  std::map<std::string, ffi::Tensor> state;
  for (const auto& item : manifest["state"].cast<json::Array>()) {
    json::Object info = item.cast<json::Object>();
    std::string name(info["name"].cast<ffi::String>());
    std::vector<int64_t> shape;
    for (const auto& d : info["shape"].cast<json::Array>()) shape.push_back(d.cast<int64_t>());
    std::string dtype(info["dtype"].cast<ffi::String>());
    const auto& e = saved.get(name, "the step's state (runner.json's state)");
    // Checked here, once: the built step does not check its inputs (backend/checked_once.py).
    if (std::string(ffi::DLDataTypeToString(e.dtype)) != dtype || e.shape != shape)
      bad_input(saved.path() + ": tensor '" + name + "' is " +
                std::string(ffi::DLDataTypeToString(e.dtype)) + " " + shape_text(e.shape) +
                "; allowed: " + dtype + " " + shape_text(shape));
    state_names.push_back(name);
    state[name] = device.upload(e.data, e.shape, e.dtype);
    saved.release(e);  // the copy is the state now: the file's pages need not stay resident
  }
  std::vector<std::string> updates;  // output i + 1 is the new value of state updates[i]
  for (const auto& n : manifest["updates"].cast<json::Array>()) updates.push_back(n.cast<ffi::String>());
  std::vector<std::pair<std::string, std::string>> weight_names;  // step name -> source name
  for (const auto& [k, v] : manifest["weights"].cast<json::Object>())
    weight_names.emplace_back(k.cast<ffi::String>(), v.cast<ffi::String>());

  // The step: its library, the VM over it on the step's device and the CPU (pooled
  // allocators, as TVM's Python VM).
  ffi::Module library = ffi::Module::LoadFromFile(args.step_dir + "/step.so");
  ffi::Module vm = library->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  constexpr int kPooled = 2;
  if (device.on_host())
    vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, kPooled);
  else
    vm->GetFunction("vm_initialization").value()(static_cast<int>(device.dl().device_type),
                                                 device.dl().device_id, kPooled,
                                                 static_cast<int>(kDLCPU), 0, kPooled);
  ffi::Function train_step = vm->GetFunction("train_step").value();
  CallProfile profile;
  if (args.profile) vm->GetFunction("set_instrument").value()(profile.instrument());

  // The state readable here: on the CPU the tensors themselves, which every step checked; on a
  // GPU a copy, each tensor checked finite (only here, per epoch: a non-finite weight makes the
  // next step's loss non-finite, which is checked every step).
  auto state_on_host = [&](const std::string& where) {
    std::vector<std::pair<std::string, ffi::Tensor>> all;
    for (const auto& [name, t] : state) {
      all.emplace_back(name, device.on_host_copy(t));
      if (!device.on_host() && !finite(all.back().second))
        throw Failure(kNotFinite, where + ": " + name + " is not finite; " + args.out_dir +
                      " keeps the state of the last finished epoch");
    }
    return all;
  };

  std::vector<std::pair<std::string, ffi::Tensor>> checkpoint;  // the last epoch's state
  std::vector<double> losses, step_ms;
  std::vector<int64_t> order(examples), logged_order;
  std::vector<ffi::AnyView> call(inputs.size() + state_names.size());
  uint64_t rng = static_cast<uint64_t>(args.seed);
  long long taken = 0;
  auto began = std::chrono::steady_clock::now();
  for (long long epoch = 0; epoch < args.epochs && taken != args.steps; ++epoch) {
    for (int64_t i = 0; i < examples; ++i) order[i] = i;
    for (int64_t i = examples - 1; i > 0; --i) std::swap(order[i], order[splitmix64(rng) % (i + 1)]);
    double epoch_loss = 0;
    int64_t epoch_steps = 0;
    for (int64_t start = 0; start + batch <= examples && taken != args.steps; start += batch) {
      for (auto& input : inputs) {
        char* into = data_of(input.batch);
        for (int64_t j = 0; j < batch; ++j)
          std::memcpy(into + j * input.example_bytes,
                      input.examples->data + order[start + j] * input.example_bytes,
                      input.example_bytes);
        if (!device.on_host()) device.write(input.on_device, into);
      }
      logged_order.insert(logged_order.end(), order.begin() + start, order.begin() + start + batch);
      size_t a = 0;
      for (auto& input : inputs) call[a++] = input.on_device;
      for (const auto& name : state_names) call[a++] = state[name];
      profile.start_step(taken > 0);
      auto t0 = std::chrono::steady_clock::now();
      ffi::Any result;
      train_step.CallPacked(call.data(), static_cast<int32_t>(call.size()), &result);
      ffi::Array<ffi::Any> outputs = result.cast<ffi::Array<ffi::Any>>();
      float value;
      device.read(outputs[0].cast<ffi::Tensor>(), &value);  // on a GPU, waits for the step
      step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      if (!device.on_host()) least_free = std::min(least_free, device.free_bytes());
      std::string where = "step " + std::to_string(taken + 1);
      if (!std::isfinite(value))
        throw Failure(kNotFinite, where + ": its loss is not finite (NaN or inf); " + args.out_dir +
                      " keeps the state of the last finished epoch. A smaller learning rate, or "
                      "data without extreme values, usually avoids it");
      for (size_t k = 0; k < updates.size(); ++k) {
        ffi::Tensor updated = outputs[k + 1].cast<ffi::Tensor>();
        if (device.on_host() && !finite(updated))
          throw Failure(kNotFinite, where + ": its new " + updates[k] + " is not finite; " +
                        args.out_dir + " keeps the state of the last finished epoch");
        ffi::Tensor& kept = state[updates[k]];
        if (resident && !updated.same_as(kept)) device.copy(updated, kept);
        else kept = updated;
      }
      losses.push_back(value);
      epoch_loss += value;
      ++epoch_steps;
      ++taken;
    }
    // a checkpoint per epoch
    checkpoint = state_on_host("epoch " + std::to_string(epoch + 1));
    save_safetensors(args.out_dir + "/state.safetensors", checkpoint);
    std::printf("epoch %lld/%lld: mean loss %.4f\n", epoch + 1, args.epochs,
                epoch_steps ? epoch_loss / epoch_steps : 0.0);
    std::fflush(stdout);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();

  // the last checkpoint is the final state: the run ends after an epoch
  std::map<std::string, ffi::Tensor> final_state(checkpoint.begin(), checkpoint.end());
  std::vector<std::pair<std::string, ffi::Tensor>> weights;
  for (const auto& [step_name, source_name] : weight_names)
    if (final_state.count(step_name)) weights.emplace_back(source_name, final_state[step_name]);
  save_safetensors(args.out_dir + "/weights.safetensors", weights);
  auto numbers = [](const auto& values, const char* format) {
    std::string text = "[";
    char buffer[32];
    for (size_t i = 0; i < values.size(); ++i) {
      std::snprintf(buffer, sizeof buffer, format, values[i]);
      text += (i ? ", " : "") + std::string(buffer);
    }
    return text + "]";
  };
  std::ostringstream log;
  log << "{\"runner\": \"native\", \"device\": \"" << (device.on_host() ? "cpu" : "cuda")
      << "\", \"epochs\": " << args.epochs << ", \"seed\": " << args.seed
      << ", \"steps\": " << losses.size() << ", \"seconds\": " << seconds
      << ", \"peak_rss_bytes\": " << peak_rss_bytes() << ", \"device_held_bytes\": "
      << (device.on_host() ? std::string("null") : std::to_string(free_at_start - least_free))
      << ",\n \"losses\": " << numbers(losses, "%.9g")  // a float32 read back exactly
      << ",\n \"step_ms\": " << numbers(step_ms, "%.4f")
      << ",\n \"order\": " << numbers(logged_order, "%lld")
      << (args.profile ? ",\n \"calls\": " + profile.json() : std::string()) << "}\n";
  write_atomic(args.out_dir + "/log.json", log.str());
  std::printf("wrote %s/weights.safetensors, state.safetensors and log.json (%zu steps)\n",
              args.out_dir.c_str(), losses.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // OpenBLAS (where the step's products run on it) on one thread: the step splits its work
  // over TVM's pool (pipelines/backend/cpu_schedules.py). Read when step.so loads it.
  setenv("OPENBLAS_NUM_THREADS", "1", 0);
  try {
    return run(parse_args(argc, argv));
  } catch (const Failure& failure) {
    std::fprintf(stderr, "error: %s\n", failure.what());
    return failure.code;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  }
}
