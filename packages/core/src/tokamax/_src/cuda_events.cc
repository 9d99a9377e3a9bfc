// CUDA-event timing for tokamax.benchmarking (method="cuda_events").
//
// An XLA FFI handler, `TokamaxRecordCudaEvent`, records a cudaEvent on the stream XLA
// gives the custom call (the stream the measured kernels run on) and passes a small
// buffer through, so the call can be ordered before and after the measured function
// with `jax.lax.optimization_barrier`. Every recorded event is appended to a
// process-wide log; Python reads it back through the extern "C" functions below
// (ctypes), after the computation has been enqueued.
//
// Built lazily by tokamax/_src/benchmarking.py with the system C++ compiler against
// `jax.ffi.include_dir()` and the CUDA runtime, e.g. (one command):
//   c++ -std=c++17 -O2 -shared -fPIC -I<jax ffi include> -I<cuda include>
//       cuda_events.cc -L<cuda lib> -l:libcudart.so.N -Wl,-rpath,<cuda lib>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#ifndef TOKAMAX_DECLARE_CUDART
#include "cuda_runtime_api.h"
#else
// The CUDA runtime headers are incomplete here (e.g. a pip nvidia-cuda-runtime without
// nvidia-cuda-crt's crt/host_defines.h): declare the few stable C entry points used.
extern "C" {
enum cudaError { cudaSuccess = 0 };
typedef enum cudaError cudaError_t;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };
#define cudaEventDefault 0x00
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
}  // extern "C"
#endif  // TOKAMAX_DECLARE_CUDART

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct LoggedEvent {
  cudaEvent_t event;
  int32_t device;
  int64_t kind;  // 0: before the measured function, 1: after it.
};

std::mutex mu;
std::vector<LoggedEvent> log_entries;         // Recorded since the last reset.
std::vector<LoggedEvent> free_events;         // Created, not in the log: reused.
cudaError_t last_error = cudaSuccess;         // First error seen by the handler.

// Makes `device` current for the calling thread; restores the previous one on exit.
class ScopedDevice {
 public:
  explicit ScopedDevice(int32_t device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      restore_ = status_ == cudaSuccess;
    }
  }
  ~ScopedDevice() {
    if (restore_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

ffi::Error CudaError(const char* what, cudaError_t status) {
  return ffi::Error::Internal(std::string("tokamax cuda_events: ") + what + " failed: " +
                              cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

// Takes an event for `device` from the pool, or creates one (with timing enabled).
cudaError_t AcquireEvent(int32_t device, cudaEvent_t* event) {
  for (size_t i = 0; i < free_events.size(); ++i) {
    if (free_events[i].device == device) {
      *event = free_events[i].event;
      free_events.erase(free_events.begin() + static_cast<std::ptrdiff_t>(i));
      return cudaSuccess;
    }
  }
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

ffi::Error RecordEvent(cudaStream_t stream, int32_t device, ffi::AnyBuffer token,
                       ffi::Result<ffi::AnyBuffer> token_out, int64_t kind) {
  // Pass the token through. It is aliased to the output, so this copies only if
  // XLA chose not to honour the alias.
  if (token_out->untyped_data() != token.untyped_data()) {
    cudaError_t status = cudaMemcpyAsync(token_out->untyped_data(), token.untyped_data(),
                                         token.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (status != cudaSuccess) return CudaError("cudaMemcpyAsync (token)", status);
  }
  std::lock_guard<std::mutex> lock(mu);
  ScopedDevice scoped(device);
  if (scoped.status() != cudaSuccess) {
    last_error = scoped.status();
    return CudaError("cudaSetDevice", scoped.status());
  }
  cudaEvent_t event;
  cudaError_t status = AcquireEvent(device, &event);
  if (status != cudaSuccess) {
    last_error = status;
    return CudaError("cudaEventCreateWithFlags", status);
  }
  status = cudaEventRecord(event, stream);
  if (status != cudaSuccess) {
    free_events.push_back({event, device, 0});
    last_error = status;
    return CudaError("cudaEventRecord", status);
  }
  log_entries.push_back({event, device, kind});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokamaxRecordCudaEvent, RecordEvent,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("kind"));

extern "C" {

// Forgets the logged events (they go back to the pool) and the last error.
void tokamax_cuda_events_reset() {
  std::lock_guard<std::mutex> lock(mu);
  for (const LoggedEvent& e : log_entries) free_events.push_back(e);
  log_entries.clear();
  last_error = cudaSuccess;
}

// Number of events recorded since the last reset.
int64_t tokamax_cuda_events_count() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int64_t>(log_entries.size());
}

// Writes the device and kind of logged event `i`; returns 0, or -1 if out of range.
int tokamax_cuda_events_info(int64_t i, int32_t* device, int64_t* kind) {
  std::lock_guard<std::mutex> lock(mu);
  if (i < 0 || i >= static_cast<int64_t>(log_entries.size())) return -1;
  *device = log_entries[i].device;
  *kind = log_entries[i].kind;
  return 0;
}

// Waits for logged event `end`, then writes the milliseconds between logged events
// `start` and `end`. Returns a cudaError_t (0 on success), or -1 if out of range.
int tokamax_cuda_events_elapsed_ms(int64_t start, int64_t end, float* ms) {
  std::lock_guard<std::mutex> lock(mu);
  const int64_t n = static_cast<int64_t>(log_entries.size());
  if (start < 0 || end < 0 || start >= n || end >= n) return -1;
  ScopedDevice scoped(log_entries[end].device);
  if (scoped.status() != cudaSuccess) return scoped.status();
  cudaError_t status = cudaEventSynchronize(log_entries[end].event);
  if (status != cudaSuccess) return status;
  status = cudaEventSynchronize(log_entries[start].event);
  if (status != cudaSuccess) return status;
  return cudaEventElapsedTime(ms, log_entries[start].event, log_entries[end].event);
}

// The first CUDA error the handler hit since the last reset (0 if none).
int tokamax_cuda_events_last_error() {
  std::lock_guard<std::mutex> lock(mu);
  return last_error;
}

// "cudaErrorX: description" for a cudaError_t.
const char* tokamax_cuda_error_name(int status) {
  return cudaGetErrorName(static_cast<cudaError_t>(status));
}
const char* tokamax_cuda_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

}  // extern "C"
