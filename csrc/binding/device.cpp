// Per-device facts (asked once per device) and the process-wide kernel family.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <c10/cuda/CUDAFunctions.h>

#include "binding/binding.h"

namespace flashkda::binding {

// Process-wide choice of the kernel family (flashkda/_ext.py sets it from
// FLASHKDA_KERNEL_FAMILY at import); read by every recurrent and chunked call.
std::atomic<int32_t> g_kernel_family{int32_t(KernelFamily::kAuto)};

void set_kernel_family(int64_t family) {
  TORCH_CHECK(family == int64_t(KernelFamily::kAuto) || family == int64_t(KernelFamily::kSm80) ||
                  family == int64_t(KernelFamily::kSm90),
              "flashkda: kernel family must be ", int(KernelFamily::kAuto), " (auto), ", int(KernelFamily::kSm80),
              " or ", int(KernelFamily::kSm90), ", got ", family);
  g_kernel_family.store(int32_t(family), std::memory_order_relaxed);
}

KernelFamily kernel_family() { return static_cast<KernelFamily>(g_kernel_family.load(std::memory_order_relaxed)); }

int num_sms(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Whether a device with `optin_bytes` of shared memory per block (opt-in limit) can run the chunked
// kernels (not sm_86, sm_89: 99 KB).
bool chunk_smem_fits(int64_t optin_bytes) { return optin_bytes >= chunk_smem_bytes(); }

// chunk_smem_fits for Python, which asks the device through torch: the reason, or None.
std::optional<std::string> chunk_smem_reason(int64_t optin_bytes) {
  if (chunk_smem_fits(optin_bytes)) return std::nullopt;
  return std::to_string(optin_bytes) + " bytes of shared memory per block (chunked kernels: " +
         std::to_string(chunk_smem_bytes()) + ")";
}

// Whether the chunked backward's gradients pass runs in value halves on `device`: on the sm_80
// family, or where the whole pass's block does not fit (sm_80's 163 KB).
bool chunk_local_grad_in_value_halves(int64_t device) {
  return kernel_family() == KernelFamily::kSm80 ||
         device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(int(device)) < chunk_local_grad_smem_bytes();
}

// Why `device` cannot run this build's kernels (compute capability below kMinComputeMajor, or no
// loadable image: a build without machine code or PTX for it), or nullptr; asked once per device.
// A failed capability query answers nullptr, so that the kernels launch and report the error.
constexpr int kMinComputeMajor = 8;  // flashkda/_ext.py: MIN_COMPUTE_CAPABILITY
const char* kernel_image_error(int device) {
  static std::atomic<int> cached[kMaxCachedDevices] = {};  // 0: not asked; 1: runs; 2: capability; 3: no image
  static const char* const kReasons[] = {nullptr, nullptr, "compute capability too low for this build",
                                         "no kernel image of this build for the GPU (FLASHKDA_CUDA_ARCHS)"};
  const bool cacheable = device_cacheable(device);
  if (cacheable) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return kReasons[known];
  }
  int major = 0, verdict = 1;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (major < kMinComputeMajor) {
    verdict = 2;
  } else {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    if (kernel_image_status() != cudaSuccess) verdict = 3;
  }
  if (cacheable) cached[device].store(verdict, std::memory_order_relaxed);
  return kReasons[verdict];
}

// kernel_image_error for Python: the reason, or None.
std::optional<std::string> kernel_image_reason(int64_t device) {
  const char* reason = kernel_image_error(int(device));
  return reason != nullptr ? std::optional<std::string>(reason) : std::nullopt;
}

}  // namespace flashkda::binding
