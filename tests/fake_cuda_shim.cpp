// Lets a CPU-only torch trace the CUDA path on fake CUDA tensors (tests/test_fake_cuda.py); nothing runs on a GPU.
//
// FakeTensorMode makes tensors on "cuda" on any torch, but on a CPU-only build two things every CUDA tensor meets
// are missing: a CUDA device guard (indexing, `float(t)` and autograd's input metadata ask it for the device and
// stream: "PyTorch is not linked with support for cuda devices"), and an accelerator for autograd's stream
// bookkeeping ("Cannot access accelerator device when none is available"). On a CUDA build without a GPU torch
// installs its own no-op guard (`c10::impl::ensureCUDADeviceGuardSet`, FakeGuardImpl) and has the hooks; this
// library does the same for a CPU-only build: torch's FakeGuardImpl as the CUDA guard, and CUDA hooks that say
// only "built" (isBuilt), so `at::getAccelerator()` is CUDA. Nothing says CUDA is *available*:
// torch.cuda.is_available() stays False, and any real CUDA call still fails.
//
// torch asks for its CUDA hooks once and keeps the answer, so this library is loaded before `import torch`, in a
// process of its own (tests/fake_cuda_run.py).

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {

struct TraceOnlyCUDAHooks final : at::CUDAHooksInterface {
  explicit TraceOnlyCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};

c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", TraceOnlyCUDAHooks)
}  // namespace at

// Install the guard; 1 if torch now uses these hooks (0: it had asked for its hooks before this library loaded).
extern "C" int fake_cuda_install() {
  c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &fake_cuda_guard);
  return at::detail::getCUDAHooks().isBuilt() ? 1 : 0;
}
