// flashgen's launcher: the torch operators that launch every emitted kernel library.
// Built once per torch installation by flashgen.launcher (g++ against torch's headers, no CUDA toolkit);
// each kernel library is built alone by nvcc and exports the C ABI of flashgen/emit/abi.py.
#include <dlfcn.h>
#include <atomic>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "flashgen_args.h"  // written next to this file from flashgen.emit.abi.args_struct("flashgen")

namespace {

// Guards: flashgen.runtime checks every eager call in Python before it gets here (with the full
// explanation); these stop a bad launch that got past it (calls traced by torch.compile). Errors are
// std exceptions, not TORCH_CHECK: on the GPU machine (torch 2.11 + CUDA 13.0) a c10::Error raised from
// an extension library ended the process. std exceptions from a minimal extension crossed the
// dispatcher cleanly there, but from this library they were also seen to end it (cause not found).
template <typename Error, typename... Parts>
[[noreturn]] void raise(const Parts&... parts) {
    std::ostringstream msg;
    (msg << ... << parts);
    throw Error(msg.str());
}
#define FG_REQUIRE(cond, ...) do { if (!(cond)) raise<std::invalid_argument>(__VA_ARGS__); } while (0)
#define FG_CHECK(cond, ...) do { if (!(cond)) raise<std::runtime_error>(__VA_ARGS__); } while (0)

using launch_fn = int (*)(const flashgen_args*, void*);
using workspace_fn = int (*)(const flashgen_args*, size_t*, size_t*);

// What a loaded kernel library was built for: the calls it may take.
struct Kernel {
    std::string name, short_form;
    launch_fn launch;
    workspace_fn workspace;
    c10::ScalarType dtype;
    int64_t d_head;
};

constexpr int64_t kMaxKernels = 1 << 16;
Kernel* registry[kMaxKernels];  // append-only: a handle stays valid for the life of the process
std::atomic<int64_t> n_kernels{0};
std::mutex load_mutex;

int64_t load_kernel(const std::string& path, const std::string& name, const std::string& short_form,
                    c10::ScalarType dtype, int64_t d_head) {
    std::lock_guard<std::mutex> lock(load_mutex);
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        const char* why = dlerror();
        raise<std::runtime_error>("flashgen: cannot load the kernel library ", path, ": ", why ? why : "unknown error");
    }
    auto launch = reinterpret_cast<launch_fn>(dlsym(lib, (name + "_launch").c_str()));
    auto workspace = reinterpret_cast<workspace_fn>(dlsym(lib, (name + "_workspace").c_str()));
    FG_CHECK(launch != nullptr && workspace != nullptr, "flashgen: ", path, " does not export ", name,
                "_launch and ", name, "_workspace");
    const int64_t id = n_kernels.load();
    FG_CHECK(id < kMaxKernels, "flashgen: more than ", kMaxKernels, " kernels loaded in one process");
    registry[id] = new Kernel{name, short_form, launch, workspace, dtype, d_head};
    n_kernels.store(id + 1);
    return id;
}

const Kernel& kernel_at(int64_t id) {
    FG_CHECK(id >= 0 && id < n_kernels.load(), "flashgen: no kernel with handle ", id, " is loaded");
    return *registry[id];
}

// The guards of a launch; flashgen.runtime turns a failure into an InputError with the full explanation.
void check_tensor(const char* what, const at::Tensor& t, const at::Tensor& q, const Kernel& kn) {
    FG_REQUIRE(t.is_cuda(), what, " is on ", t.device(), "; flashgen kernels run on CUDA devices");
    FG_REQUIRE(t.scalar_type() == kn.dtype, what, " has dtype ", t.scalar_type(), ", this kernel was built for ",
                      kn.dtype, " (", kn.short_form, ")");
    FG_REQUIRE(t.dim() == 4, what, " must be 4-D (batch, seq, heads, d_head), got shape ", t.sizes());
    FG_REQUIRE(t.size(3) == kn.d_head, what, " has d_head=", t.size(3), ", this kernel was built for d_head=", kn.d_head);
    FG_REQUIRE(t.stride(3) == 1, what, ": the last (d_head) dimension must be contiguous, got stride ", t.stride(3));
    FG_REQUIRE(t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                      what, ": rows must be 16-byte aligned (strides ", t.strides(), " in elements must be multiples of 8)");
    FG_REQUIRE(t.device() == q.device(), what, " is on ", t.device(), " but q is on ", q.device());
}

void check_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* out, const Kernel& kn) {
    check_tensor("q", q, q, kn);
    check_tensor("k", k, q, kn);
    check_tensor("v", v, q, kn);
    if (out != nullptr) check_tensor("out", *out, q, kn);
    FG_REQUIRE(k.sizes() == v.sizes(), "k ", k.sizes(), " and v ", v.sizes(), " must have the same shape");
    FG_REQUIRE(k.size(0) == q.size(0), "k/v batch ", k.size(0), " must match q's ", q.size(0));
    FG_REQUIRE(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "q's ", q.size(2), " heads must be a multiple of k/v's ",
                      k.size(2), " heads");
    FG_REQUIRE(q.size(1) > 0 && k.size(1) > 0, "sequence lengths must be >= 1, got seq_q=", q.size(1),
                      ", seq_k=", k.size(1));
    FG_REQUIRE(q.size(0) > 0 && q.size(2) > 0, "batch and heads must be >= 1, got batch=", q.size(0),
                      ", heads=", q.size(2));
    if (out != nullptr) FG_REQUIRE(out->sizes() == q.sizes(), "out has shape ", out->sizes(), ", expected ", q.sizes());
}

at::Tensor launch(const Kernel& kn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                  double softmax_scale, int64_t mask_offset, int64_t window_left, int64_t window_right, bool return_lse) {
    const c10::DeviceGuard guard(q.device());
    at::Tensor lse = at::empty(return_lse ? at::IntArrayRef{q.size(0), q.size(2), q.size(1)} : at::IntArrayRef{0},
                               q.options().dtype(at::kFloat));
    flashgen_args a{};
    a.q = q.data_ptr(); a.k = k.data_ptr(); a.v = v.data_ptr(); a.o = out.data_ptr();
    a.lse = return_lse ? lse.data_ptr<float>() : nullptr;
    const at::Tensor* ts[4] = {&q, &k, &v, &out};
    int64_t* strides[4] = {a.q_stride, a.k_stride, a.v_stride, a.o_stride};
    for (int i = 0; i < 4; ++i) {  // (batch, head, seq): the struct's order
        strides[i][0] = ts[i]->stride(0); strides[i][1] = ts[i]->stride(2); strides[i][2] = ts[i]->stride(1);
    }
    if (return_lse) { a.lse_stride[0] = lse.stride(0); a.lse_stride[1] = lse.stride(1); }
    a.batch = int(q.size(0)); a.heads = int(q.size(2)); a.kv_heads = int(k.size(2));
    a.seq_q = int(q.size(1)); a.seq_k = int(k.size(1));
    a.softmax_scale = float(softmax_scale);
    a.mask_offset = int(mask_offset); a.window_left = int(window_left); a.window_right = int(window_right);
    // scratch the launch asks for (a persistent kernel's wave-tail split), from torch's allocator on this
    // stream: freed when this returns, reused only by work queued after the launch
    size_t ws_bytes = 0, ws_zeroed = 0;
    int err = kn.workspace(&a, &ws_bytes, &ws_zeroed);
    FG_CHECK(err == 0, kn.name, ": workspace query failed with cudaError_t ", err);
    at::Tensor ws;
    if (ws_bytes) {
        ws = at::empty({int64_t(ws_bytes)}, q.options().dtype(at::kByte));
        if (ws_zeroed) ws.narrow(0, 0, int64_t(ws_zeroed)).zero_();
        a.workspace = ws.data_ptr();
    }
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(q.device().type())->getStream(q.device());
    err = kn.launch(&a, stream.native_handle());
    FG_CHECK(err == 0, kn.name, ": launch failed with cudaError_t ", err,
             err == 209 ? " (no kernel image for this GPU: check its compute capability)" : "");
    return lse;
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t kernel,
                                             double softmax_scale, int64_t mask_offset, int64_t window_left,
                                             int64_t window_right, bool return_lse) {
    const Kernel& kn = kernel_at(kernel);
    check_call(q, k, v, nullptr, kn);
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = launch(kn, q, k, v, out, softmax_scale, mask_offset, window_left, window_right, return_lse);
    return {out, lse};
}

at::Tensor attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, int64_t kernel,
                         double softmax_scale, int64_t mask_offset, int64_t window_left, int64_t window_right,
                         bool return_lse) {
    const Kernel& kn = kernel_at(kernel);
    check_call(q, k, v, &out, kn);
    return launch(kn, q, k, v, out, softmax_scale, mask_offset, window_left, window_right, return_lse);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashgen, m) {
    m.def("load_kernel(str path, str name, str short_form, ScalarType dtype, int d_head) -> int", &load_kernel);
}

// CPU too, so a CPU tensor gets the device check's message rather than "no kernel for CPU".
TORCH_LIBRARY_IMPL(flashgen, CUDA, m) {
    m.impl("attention", &attention);
    m.impl("attention_out", &attention_out);
}
TORCH_LIBRARY_IMPL(flashgen, CPU, m) {
    m.impl("attention", &attention);
    m.impl("attention_out", &attention_out);
}
