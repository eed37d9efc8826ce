// CUDA faked on a build of torch without it (lightning_dist/_compat/fake_cuda.py builds and loads this).
// Three registrations: c10's own FakeGuardImpl as the CUDA device guard (device index state, no driver), CUDA hooks
// that say CUDA is there with $LIGHTNING_DIST_FAKE_CUDA_DEVICES devices, and DDP's step timer on the host. Loaded before torch is imported:
// ATen reads the hooks once. A CUDA build's own libraries register theirs as torch loads: the hooks here are
// preferred over them (the registry keeps the higher priority, saying so on stderr), and the guard, which the last
// registration wins, is registered again once torch is loaded (`fake_cuda_register_guard`).
// Built against each installed wheel's headers; checked on torch 2.11.0 (CUDA build), 2.13.0 (CPU) and 2.15.0 (CUDA).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <cstdlib>

namespace at {
struct FakeCUDAHooks final : CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs /*unused*/) {}
  static int devices() {
    const char* count = std::getenv("LIGHTNING_DIST_FAKE_CUDA_DEVICES");
    return count ? std::atoi(count) : c10::impl::kFakeGuardImplMaxDevices;
  }
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return true; }
  int getNumGPUs() const override { return devices(); }
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(devices()); }
};
// Under the name ATen asks its registry for ("CUDAHooks").
C10_REGISTER_CLASS_WITH_PRIORITY(CUDAHooksRegistry, CUDAHooks, c10::REGISTRY_PREFERRED, FakeCUDAHooks);
}  // namespace at

namespace c10::impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}  // namespace c10::impl

namespace c10d {
// DDP's step timer for a module on CUDA: a CUDA build's records CUDA events, which need a device; this one records
// host time, as the CPU timer does (its figures are DDP's logging only).
struct FakeCUDATimer final : Timer {
  explicit FakeCUDATimer(c10::Device /*unused*/) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto started = getTimestamp(start), ended = getTimestamp(end);
    if (!started || !ended) return std::nullopt;
    return *ended - *started;
  }
};
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(TimerRegistry, c10::kCUDA, c10::REGISTRY_PREFERRED, FakeCUDATimer);
}  // namespace c10d

extern "C" void fake_cuda_register_guard() {
  static const c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
  c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &guard);
}
