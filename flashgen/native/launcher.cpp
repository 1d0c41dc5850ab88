// flashgen's launcher: the torch operators (traced calls) and the Python entry points (eager calls) that
// launch every emitted kernel library.
// Built once per torch installation by flashgen.launcher (g++ against torch's headers, no CUDA toolkit);
// each kernel library is built alone by nvcc and exports the C ABI of flashgen/emit/abi.py.
#include <dlfcn.h>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>
#include <c10/util/accumulate.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>  // the captured tensors a ModReader reads
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor caster: the eager entry points

#include "flashgen_args.h"  // written next to this file from flashgen.emit.abi: flashgen_args, flashgen_bwd_args

namespace {

// Guards: every call is checked here before launch. Messages are built from std::string and
// std::to_string, never through an iostream: on the GPU machine (torch 2.11 built with a Red Hat GCC
// 13.3 toolset, this library with the system's GCC 13.3) writing a number to an ostream in this library
// crashed the process, which is what made exceptions from it look fatal.
inline std::string text(const std::string& s) { return s; }
inline std::string text(const char* s) { return s; }
template <typename Int, std::enable_if_t<std::is_integral_v<Int>, int> = 0>
std::string text(Int value) { return std::to_string(value); }
inline std::string text(double value) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", value);
    return buf;
}
inline std::string text(c10::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }
inline std::string text(c10::IntArrayRef values) {
    std::string s = "[";
    for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
    return s + "]";
}

template <typename Error, typename... Parts>
[[noreturn]] void raise(const Parts&... parts) {
    std::string msg;
    ((msg += text(parts)), ...);
    throw Error(msg);
}
#define FG_REQUIRE(cond, ...) do { if (!(cond)) raise<std::invalid_argument>(__VA_ARGS__); } while (0)
#define FG_CHECK(cond, ...) do { if (!(cond)) raise<std::runtime_error>(__VA_ARGS__); } while (0)

// A library's two entry points, typed by its argument struct (a forward's or a backward's).
template <class Args>
struct EntryPoints {
    int (*launch)(const Args*, void*);
    int (*workspace)(const Args*, size_t*, size_t*);
};

// What a loaded kernel library was built for: the calls it may take.
struct Kernel {
    std::string name, short_form;
    bool backward;  // a backward library (flashgen_bwd_args) rather than a forward one
    void* launch;
    void* workspace;
    void* mask_blocks;  // <name>_mask_blocks of a kernel built with a mask_mod, else nullptr
    void* block_mask_numel;  // <name>_block_mask_numel: the int32 count of a call's block mask (with mask_blocks)
    c10::ScalarType dtype;
    int64_t d_head;
    std::atomic<uint64_t> devices_ok{0};  // bit i: flashgen.runtime checked CUDA device i can run this kernel

    template <class Args>
    EntryPoints<Args> entry_points() const {
        FG_CHECK((backward == std::is_same_v<Args, flashgen_bwd_args>), "flashgen: kernel ", name, " is a ",
             backward ? "backward" : "forward", " kernel, called as the other kind");
        return {reinterpret_cast<int (*)(const Args*, void*)>(launch),
                reinterpret_cast<int (*)(const Args*, size_t*, size_t*)>(workspace)};
    }
};

constexpr int64_t kMaxKernels = 1 << 16;
Kernel* registry[kMaxKernels];  // append-only: a handle stays valid for the life of the process
std::atomic<int64_t> n_kernels{0};
std::mutex load_mutex;

int64_t load_kernel(const std::string& path, const std::string& name, const std::string& short_form,
                    c10::ScalarType dtype, int64_t d_head, bool backward) {
    std::lock_guard<std::mutex> lock(load_mutex);
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        const char* why = dlerror();
        raise<std::runtime_error>("flashgen: cannot load the kernel library ", path, ": ", why ? why : "unknown error");
    }
    void* launch = dlsym(lib, (name + "_launch").c_str());
    void* workspace = dlsym(lib, (name + "_workspace").c_str());
    FG_CHECK(launch != nullptr && workspace != nullptr, "flashgen: ", path, " does not export ", name,
                "_launch and ", name, "_workspace");
    const int64_t id = n_kernels.load();
    FG_CHECK(id < kMaxKernels, "flashgen: more than ", kMaxKernels, " kernels loaded in one process");
    void* mask_blocks = dlsym(lib, (name + "_mask_blocks").c_str());  // optional
    void* block_mask_numel = dlsym(lib, (name + "_block_mask_numel").c_str());
    FG_CHECK((mask_blocks == nullptr) == (block_mask_numel == nullptr), "flashgen: ", path, " exports only one of ", name,
             "_mask_blocks and ", name, "_block_mask_numel");
    registry[id] = new Kernel{name, short_form, backward, launch, workspace, mask_blocks, block_mask_numel, dtype, d_head};
    n_kernels.store(id + 1);
    return id;
}

const Kernel& kernel_at(int64_t id) {
    FG_CHECK(id >= 0 && id < n_kernels.load(), "flashgen: no kernel with handle ", id, " is loaded");
    return *registry[id];
}

// A kernel that an operator of the other kind (forward or backward) is asked to run is refused before
// anything else is checked: the argument structs differ.
const Kernel& kernel_at(int64_t id, bool backward) {
    const Kernel& kn = kernel_at(id);
    FG_CHECK(kn.backward == backward, "flashgen: kernel ", id, " (", kn.short_form, ") is a ",
             kn.backward ? "backward" : "forward", " kernel; the ", backward ? "backward" : "forward",
             " operator cannot run it");
    return kn;
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

// The kernels keep each row's largest raw score (the largest scaled one only for a positive scale), and a score_mod
// that adds a bias holds it over the scale: a positive fp32 scale with a finite fp32 inverse (flashgen.runtime's rule).
void check_scale(double softmax_scale) {
    const float s = float(softmax_scale);
    FG_REQUIRE(s > 0.0f && std::isfinite(s) && std::isfinite(1.0f / s), "softmax_scale=", softmax_scale,
               ": expected a positive number between 2.94e-39 and 3.4e+38 (an fp32 number whose inverse is one too)");
}

void check_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* out, const Kernel& kn,
                double softmax_scale) {
    check_scale(softmax_scale);
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

// (batch, head, seq) element strides of a (batch, seq, heads, d_head) tensor: the argument structs' order
void strides_of(const at::Tensor& t, int64_t* s) { s[0] = t.stride(0); s[1] = t.stride(2); s[2] = t.stride(1); }

// Ask the library for the scratch a launch with `a` uses, take it from torch's allocator on q's stream (freed
// when this returns, reused only by work queued after the launch), and launch there.
template <class Args>
void run_library(const Kernel& kn, Args& a, const at::Tensor& q) {
    const EntryPoints<Args> entry = kn.entry_points<Args>();
    size_t ws_bytes = 0, ws_zeroed = 0;
    int err = entry.workspace(&a, &ws_bytes, &ws_zeroed);
    FG_CHECK(err == 0, kn.name, ": workspace query failed with cudaError_t ", err);
    at::Tensor ws;
    if (ws_bytes) {
        ws = at::empty({int64_t(ws_bytes)}, q.options().dtype(at::kByte));
        if (ws_zeroed) ws.narrow(0, 0, int64_t(ws_zeroed)).zero_();
        a.workspace = ws.data_ptr();
    }
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(q.device().type())->getStream(q.device());
    err = entry.launch(&a, stream.native_handle());
    FG_CHECK(err == 0, kn.name, ": launch failed with cudaError_t ", err,
             err == 209 ? " (no kernel image for this GPU: check its compute capability)" : "");
}

at::Tensor launch(const Kernel& kn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                  double softmax_scale, int64_t mask_offset, int64_t window_left, int64_t window_right, bool return_lse,
                  const std::vector<int64_t>* mod_words = nullptr, const int* block_mask = nullptr) {
    const c10::DeviceGuard guard(q.device());
    at::Tensor lse = at::empty(return_lse ? at::IntArrayRef{q.size(0), q.size(2), q.size(1)} : at::IntArrayRef{0},
                               q.options().dtype(at::kFloat));
    flashgen_args a{};
    a.q = q.data_ptr(); a.k = k.data_ptr(); a.v = v.data_ptr(); a.o = out.data_ptr();
    a.lse = return_lse ? lse.data_ptr<float>() : nullptr;
    strides_of(q, a.q_stride); strides_of(k, a.k_stride); strides_of(v, a.v_stride); strides_of(out, a.o_stride);
    if (return_lse) { a.lse_stride[0] = lse.stride(0); a.lse_stride[1] = lse.stride(1); }
    a.batch = int(q.size(0)); a.heads = int(q.size(2)); a.kv_heads = int(k.size(2));
    a.seq_q = int(q.size(1)); a.seq_k = int(k.size(1));
    a.softmax_scale = float(softmax_scale);
    a.mask_offset = int(mask_offset); a.window_left = int(window_left); a.window_right = int(window_right);
    if (mod_words != nullptr) { a.mod_words = mod_words->data(); a.n_mod_words = int(mod_words->size()); }
    a.block_mask = block_mask;
    run_library(kn, a, q);
    return lse;
}

// lse or its gradient: fp32 (batch, heads, seq_q), contiguous, on q's device
void check_row_stats(const char* what, const at::Tensor& t, const at::Tensor& q) {
    FG_REQUIRE(t.device() == q.device(), what, " is on ", t.device(), " but q is on ", q.device());
    FG_REQUIRE(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
    FG_REQUIRE(t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(2) && t.size(2) == q.size(1), what,
               " must have shape (batch, heads, seq_q) = [", q.size(0), ", ", q.size(2), ", ", q.size(1), "], got ", t.sizes());
    FG_REQUIRE(t.is_contiguous(), what, " must be contiguous");
}

std::vector<int64_t> mod_words_of(const at::Tensor& q, c10::IntArrayRef mod_words, at::TensorList mod_tensors);

// dq, dk, dv of the attention whose forward gave `out` and `lse`, through backward kernel `kernel`; `mod_words`: the
// values of the score_mod / mask_mod it is built with (mod_words_of), or none
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_launch(
        const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
        const at::Tensor& lse, const std::optional<at::Tensor>& dlse, int64_t kernel, double softmax_scale,
        int64_t mask_offset, int64_t window_left, int64_t window_right, const std::vector<int64_t>* mod_words,
        const int* block_mask = nullptr) {
    const Kernel& kn = kernel_at(kernel, true);
    check_call(q, k, v, &out, kn, softmax_scale);
    check_tensor("dout", dout, q, kn);
    FG_REQUIRE(dout.sizes() == q.sizes(), "dout has shape ", dout.sizes(), ", expected ", q.sizes());
    check_row_stats("lse", lse, q);
    if (dlse.has_value()) check_row_stats("dlse", *dlse, q);
    const c10::DeviceGuard guard(q.device());
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    flashgen_bwd_args a{};
    a.q = q.data_ptr(); a.k = k.data_ptr(); a.v = v.data_ptr(); a.o = out.data_ptr(); a.dout = dout.data_ptr();
    a.dq = dq.data_ptr(); a.dk = dk.data_ptr(); a.dv = dv.data_ptr();
    a.lse = lse.data_ptr<float>();
    a.dlse = dlse.has_value() ? dlse->data_ptr<float>() : nullptr;
    strides_of(q, a.q_stride); strides_of(k, a.k_stride); strides_of(v, a.v_stride); strides_of(out, a.o_stride);
    strides_of(dout, a.do_stride); strides_of(dq, a.dq_stride); strides_of(dk, a.dk_stride); strides_of(dv, a.dv_stride);
    a.batch = int(q.size(0)); a.heads = int(q.size(2)); a.kv_heads = int(k.size(2));
    a.seq_q = int(q.size(1)); a.seq_k = int(k.size(1));
    a.softmax_scale = float(softmax_scale);
    a.mask_offset = int(mask_offset); a.window_left = int(window_left); a.window_right = int(window_right);
    if (mod_words != nullptr) { a.mod_words = mod_words->data(); a.n_mod_words = int(mod_words->size()); }
    a.block_mask = block_mask;
    run_library(kn, a, q);
    return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
        const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
        const at::Tensor& lse, const std::optional<at::Tensor>& dlse, int64_t kernel, double softmax_scale,
        int64_t mask_offset, int64_t window_left, int64_t window_right) {
    return backward_launch(dout, q, k, v, out, lse, dlse, kernel, softmax_scale, mask_offset, window_left, window_right, nullptr);
}

void check_block_mask(const Kernel& kn, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& block_mask);

// The backward through a kernel built with a score_mod / mask_mod, on the values of the forward call; `block_mask`
// from mask_blocks with this backward kernel's handle (or none: every block masked, none skipped).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_mods(
        const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
        const at::Tensor& lse, const std::optional<at::Tensor>& dlse, int64_t kernel, double softmax_scale,
        int64_t mask_offset, int64_t window_left, int64_t window_right, c10::IntArrayRef mod_words,
        at::TensorList mod_tensors, const std::optional<at::Tensor>& block_mask) {
    check_block_mask(kernel_at(kernel, true), q, k, block_mask);
    const std::vector<int64_t> words = mod_words_of(q, mod_words, mod_tensors);
    return backward_launch(dout, q, k, v, out, lse, dlse, kernel, softmax_scale, mask_offset, window_left, window_right, &words,
                           block_mask.has_value() ? block_mask->data_ptr<int>() : nullptr);
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t kernel,
                                             double softmax_scale, int64_t mask_offset, int64_t window_left,
                                             int64_t window_right, bool return_lse) {
    const Kernel& kn = kernel_at(kernel, false);
    check_call(q, k, v, nullptr, kn, softmax_scale);
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = launch(kn, q, k, v, out, softmax_scale, mask_offset, window_left, window_right, return_lse);
    return {out, lse};
}

// The values of a score_mod / mask_mod: `mod_words` (the scalars) followed by each of `mod_tensors` as its
// address and strides (flashgen.mods.KernelMods' word order); the kernel checks the count.
std::vector<int64_t> mod_words_of(const at::Tensor& q, c10::IntArrayRef mod_words, at::TensorList mod_tensors) {
    std::vector<int64_t> words(mod_words.begin(), mod_words.end());
    for (const at::Tensor& t : mod_tensors) {
        FG_REQUIRE(t.device() == q.device(), "a tensor captured by a score_mod / mask_mod is on ", t.device(),
                   " but q is on ", q.device());
        words.push_back(int64_t(reinterpret_cast<uintptr_t>(t.data_ptr())));
        for (int64_t d = 0; d < t.dim(); ++d) words.push_back(t.stride(d));
    }
    return words;
}

// A call's sizes and (`words`, or none) its mods' values in a kernel's own argument struct, a forward's
// (flashgen_args) or a backward's (flashgen_bwd_args): what <name>_block_mask_numel and <name>_mask_blocks read.
template <class Args>
Args sizes_of(const at::Tensor& q, const at::Tensor& k, const std::vector<int64_t>* words) {
    Args a{};
    a.batch = int(q.size(0)); a.heads = int(q.size(2)); a.kv_heads = int(k.size(2));
    a.seq_q = int(q.size(1)); a.seq_k = int(k.size(1));
    if (words != nullptr) { a.mod_words = words->data(); a.n_mod_words = int(words->size()); }
    return a;
}

template <class Args>
int64_t block_mask_numel_as(const Kernel& kn, const at::Tensor& q, const at::Tensor& k) {
    const Args a = sizes_of<Args>(q, k, nullptr);
    return reinterpret_cast<int64_t (*)(const Args*)>(kn.block_mask_numel)(&a);
}

// The int32 count of the block mask a call with q's and k's sizes has (the kernel's own rule: a forward's, or a
// backward's transposed one), so that a tensor of another size is refused before a kernel reads or writes past it.
int64_t block_mask_numel(const Kernel& kn, const at::Tensor& q, const at::Tensor& k) {
    FG_REQUIRE(kn.block_mask_numel != nullptr, "flashgen: kernel ", kn.short_form, " has no mask_mod (no block mask)");
    FG_REQUIRE(q.dim() == 4 && k.dim() == 4, "q and k must be 4-D (batch, seq, heads, d_head)");
    return kn.backward ? block_mask_numel_as<flashgen_bwd_args>(kn, q, k) : block_mask_numel_as<flashgen_args>(kn, q, k);
}

// A block mask given to a launch: int32, contiguous, on q's device, of the size this kernel's rule gives.
void check_block_mask(const Kernel& kn, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& block_mask) {
    if (!block_mask.has_value()) return;
    FG_REQUIRE(block_mask->device() == q.device() && block_mask->scalar_type() == at::kInt && block_mask->is_contiguous(),
               "block_mask must be a contiguous int32 tensor on q's device (from flashgen::mask_blocks)");
    const int64_t want = block_mask_numel(kn, q, k);
    FG_REQUIRE(block_mask->numel() == want, "block_mask has ", block_mask->numel(), " elements; a call with these sizes "
               "needs ", want, " (flashgen::mask_blocks with this kernel's handle makes it)");
}

// Attention through a kernel built with a score_mod / mask_mod; `block_mask` from mask_blocks (or none).
std::tuple<at::Tensor, at::Tensor> attention_mods(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  int64_t kernel, double softmax_scale, int64_t mask_offset,
                                                  int64_t window_left, int64_t window_right, bool return_lse,
                                                  c10::IntArrayRef mod_words, at::TensorList mod_tensors,
                                                  const std::optional<at::Tensor>& block_mask) {
    const Kernel& kn = kernel_at(kernel, false);
    check_block_mask(kn, q, k, block_mask);
    check_call(q, k, v, nullptr, kn, softmax_scale);
    const std::vector<int64_t> words = mod_words_of(q, mod_words, mod_tensors);
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = launch(kn, q, k, v, out, softmax_scale, mask_offset, window_left, window_right, return_lse, &words,
                            block_mask.has_value() ? block_mask->data_ptr<int>() : nullptr);
    return {out, lse};
}

template <class Args>
int mask_blocks_as(const Kernel& kn, const at::Tensor& q, const at::Tensor& k, const std::vector<int64_t>& words,
                   int64_t mask_offset, int64_t window_left, int64_t window_right, int* out, void* stream) {
    Args a = sizes_of<Args>(q, k, &words);
    a.mask_offset = int(mask_offset); a.window_left = int(window_left); a.window_right = int(window_right);
    return reinterpret_cast<int (*)(const Args*, int*, void*)>(kn.mask_blocks)(&a, out, stream);
}

// The block mask (int32, `shape`: flashgen.mods.KernelMods.block_mask_shape, transposed for a backward kernel) of a
// kernel built with a mask_mod, forward or backward, for calls with q's and k's sizes and these mod values; the call's
// built-in mask (mask_offset, window) weighs the tiles of a forward's tile order.
at::Tensor mask_blocks(const at::Tensor& q, const at::Tensor& k, int64_t kernel, c10::IntArrayRef shape,
                       c10::IntArrayRef mod_words, at::TensorList mod_tensors, int64_t mask_offset, int64_t window_left,
                       int64_t window_right) {
    const Kernel& kn = kernel_at(kernel);
    FG_REQUIRE(kn.mask_blocks != nullptr, "flashgen: kernel ", kn.short_form, " has no mask_mod (no block mask)");
    FG_REQUIRE(q.is_cuda() && q.dim() == 4 && k.dim() == 4, "mask_blocks: q and k must be 4-D CUDA tensors");
    const int64_t want = block_mask_numel(kn, q, k);
    FG_REQUIRE(c10::multiply_integers(shape) == want, "mask_blocks: shape ", shape, " holds ", c10::multiply_integers(shape),
               " elements; this kernel writes ", want, " for these sizes (flashgen.mods.KernelMods.block_mask_shape)");
    const std::vector<int64_t> words = mod_words_of(q, mod_words, mod_tensors);
    const c10::DeviceGuard guard(q.device());
    at::Tensor out = at::empty(shape, q.options().dtype(at::kInt));
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(q.device().type())->getStream(q.device());
    const auto make = kn.backward ? &mask_blocks_as<flashgen_bwd_args> : &mask_blocks_as<flashgen_args>;
    const int err = make(kn, q, k, words, mask_offset, window_left, window_right, out.data_ptr<int>(), stream.native_handle());
    FG_CHECK(err == 0, kn.name, ": the block mask failed with cudaError_t ", err);
    return out;
}

at::Tensor attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, int64_t kernel,
                         double softmax_scale, int64_t mask_offset, int64_t window_left, int64_t window_right,
                         bool return_lse) {
    const Kernel& kn = kernel_at(kernel, false);
    check_call(q, k, v, &out, kn, softmax_scale);
    return launch(kn, q, k, v, out, softmax_scale, mask_offset, window_left, window_right, return_lse);
}

// ---- eager entry points -------------------------------------------------------------------------
// flashgen.runtime's eager calls come here instead of through the dispatcher: pybind11 parses the
// arguments and the call costs about what a built-in torch op costs. The checks and the launch are the
// operators'. A failed check raises here and this library's own pybind11 handlers turn it into a Python
// exception (ValueError / RuntimeError; TypeError for arguments of the wrong type); Python then explains
// it with an InputError. A call returns None when Python has something to do first: check the device's
// compute capability for this kernel (once per device), pick the kernel for a new shape, or record a call
// to differentiate through the operator.
// Every entry point runs under the GIL, which serialises the tables below.
namespace py = pybind11;

bool device_checked(const Kernel& kn, const at::Tensor& q) {
    const int index = q.is_cuda() ? q.device().index() : -1;
    return index >= 0 && index < 64 && ((kn.devices_ok.load(std::memory_order_relaxed) >> index) & 1);
}

void allow_device(int64_t kernel, int64_t index) {
    FG_CHECK(index >= 0 && index < 64, "flashgen: CUDA device index ", index, " out of range");
    const_cast<Kernel&>(kernel_at(kernel)).devices_ok.fetch_or(uint64_t(1) << index);
}

int64_t mask_offset(const std::string& align, const at::Tensor& q, const at::Tensor& k) {
    if (align == "top_left") return 0;
    FG_REQUIRE(align == "bottom_right", "align='", align, "': expected 'top_left' or 'bottom_right'");
    return k.size(1) - q.size(1);
}

py::object call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const py::object& out, int64_t kernel,
                const py::object& softmax_scale, int64_t window_left, int64_t window_right, const std::string& align,
                bool return_lse) {
    const Kernel& kn = kernel_at(kernel, false);
    if (!device_checked(kn, q)) return py::none();
    if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
        return py::none();  // a call to differentiate: Python takes the operator, which autograd records
    const double scale = softmax_scale.is_none() ? 1.0 / std::sqrt(double(kn.d_head)) : softmax_scale.cast<double>();
    at::Tensor o;
    if (out.is_none()) {
        check_call(q, k, v, nullptr, kn, scale);
        o = at::empty_like(q);
    } else {
        o = out.cast<at::Tensor>();
        check_call(q, k, v, &o, kn, scale);
    }
    at::Tensor lse = launch(kn, q, k, v, o, scale, mask_offset(align, q, k), window_left, window_right, return_lse);
    if (!out.is_none() && !return_lse) return out;
    return return_lse ? py::make_tuple(o, lse) : py::cast(o);
}

// A kernel built with a score_mod / mask_mod (attention_mods' checks and launch), without the dispatcher:
// `mod_words` the scalars, `mod_tensors` the captured tensors (flashgen.mods.KernelMods.pack), `block_mask`
// from mask_blocks or None. None as for `call`.
py::object call_mods(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t kernel,
                     const py::object& softmax_scale, int64_t window_left, int64_t window_right, const std::string& align,
                     bool return_lse, const std::vector<int64_t>& mod_words, const std::vector<at::Tensor>& mod_tensors,
                     const std::optional<at::Tensor>& block_mask) {
    const Kernel& kn = kernel_at(kernel, false);
    if (!device_checked(kn, q)) return py::none();
    if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
        return py::none();  // a call to differentiate: Python decides
    const double scale = softmax_scale.is_none() ? 1.0 / std::sqrt(double(kn.d_head)) : softmax_scale.cast<double>();
    auto [o, lse] = attention_mods(q, k, v, kernel, scale, mask_offset(align, q, k), window_left, window_right,
                                   return_lse, mod_words, mod_tensors, block_mask);
    return return_lse ? py::make_tuple(o, lse) : py::cast(o);
}

// compile("auto")'s dispatch tables: (device, dtype, d_head, seq_q, mask) -> kernel handle.
constexpr size_t kMaxDispatch = 4096;  // distinct keys a table remembers before it starts afresh
std::vector<std::unordered_map<uint64_t, int64_t>> dispatch_tables;

uint64_t dispatch_key(const at::Tensor& q, int64_t mask) {
    return (uint64_t(q.device().index() & 0xff) << 56) | (uint64_t(uint8_t(q.scalar_type())) << 48) |
           (uint64_t(q.size(3) & 0xffff) << 32) | (uint64_t(mask & 0x3) << 30) | uint64_t(q.size(1) & 0x3fffffff);
}

bool keyable(const at::Tensor& q) { return q.is_cuda() && q.dim() == 4 && q.size(1) < (1 << 30) && q.size(3) < (1 << 16); }

struct ModReader;
// Each dispatch table's readers of calls with a score_mod / mask_mod (the section below).
struct ModKey {
    uint64_t call;  // dispatch_key of the call (an AutoAttention's table), or 0 (an Attention's own)
    uintptr_t score, mask;  // the function objects (None's address for none)
    bool operator==(const ModKey& o) const { return call == o.call && score == o.score && mask == o.mask; }
};
struct ModKeyHash {
    size_t operator()(const ModKey& k) const {
        return std::hash<uint64_t>()(k.call ^ (uint64_t(k.score) * 0x9e3779b97f4a7c15ull) ^ (uint64_t(k.mask) << 1));
    }
};
std::vector<std::unordered_map<ModKey, std::shared_ptr<ModReader>, ModKeyHash>> mod_tables;

int64_t new_dispatch_table() {
    dispatch_tables.emplace_back();
    mod_tables.emplace_back();
    return int64_t(dispatch_tables.size()) - 1;
}

std::unordered_map<uint64_t, int64_t>& table_at(int64_t table) {
    FG_CHECK(table >= 0 && table < int64_t(dispatch_tables.size()), "flashgen: no dispatch table ", table);
    return dispatch_tables[size_t(table)];
}

void remember(int64_t table, const at::Tensor& q, int64_t mask, int64_t kernel) {
    FG_REQUIRE(keyable(q), "flashgen: a dispatch key needs a 4-D CUDA tensor");
    kernel_at(kernel);
    auto& entries = table_at(table);
    if (entries.size() >= kMaxDispatch) entries.clear();
    entries[dispatch_key(q, mask)] = kernel;
}

py::object dispatch(int64_t table, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const py::object& out,
                    const py::object& softmax_scale, int64_t mask, int64_t window_left, int64_t window_right,
                    const std::string& align, bool return_lse) {
    if (!keyable(q)) return py::none();
    const auto& entries = table_at(table);
    const auto hit = entries.find(dispatch_key(q, mask));
    if (hit == entries.end()) return py::none();
    return call(q, k, v, out, hit->second, softmax_scale, window_left, window_right, align, return_lse);
}


// ---- repeated calls with a score_mod / mask_mod -------------------------------------------------
// flashgen.mods.call_values.CallValues says what a repeated call with one pair of function objects reads and when
// a value is stale. Its ModReader here is built from it and holds the same places and rules; after each call
// through Python's path, Python gives it the state that call's read left (each captured tensor's source, version,
// dtype and the copy passed; the block mask of the mask_mod's words and the call's sizes). A call that this state
// and these rules do not serve exactly as CallValues would gets None, and Python's path runs.

// Where a captured value lives: a closure cell, or a key of a function's globals dictionary.
struct Place {
    py::object cell, globals, key;  // cell None: a global

    static Place of(const py::handle& place) {  // (cell, None, None) or (None, globals, key)
        const auto t = place.cast<py::tuple>();
        FG_REQUIRE(t.size() == 3, "a place is (cell, globals, key)");
        Place p{py::reinterpret_borrow<py::object>(t[0]), py::reinterpret_borrow<py::object>(t[1]),
                py::reinterpret_borrow<py::object>(t[2])};
        FG_REQUIRE(p.cell.is_none() ? PyDict_CheckExact(p.globals.ptr()) && PyUnicode_CheckExact(p.key.ptr())
                                    : bool(PyCell_Check(p.cell.ptr())),
                   "a place is a closure cell, or a globals dict and a name");
        return p;
    }
    // the value now, or a null object: an empty cell, a missing global (CallValues: ValueError / KeyError)
    py::object read() const {
        PyObject* v = cell.is_none() ? PyDict_GetItemWithError(globals.ptr(), key.ptr()) : PyCell_GET(cell.ptr());
        if (v == nullptr) {
            PyErr_Clear();
            return py::object();
        }
        return py::reinterpret_borrow<py::object>(v);
    }
};

// A value whose comparison runs no Python code: an exact int, float, str, bool or None, or a tuple of such values
// (a literal of a trace: flashgen.mods.trace._compiled_in).
bool plain(PyObject* v) {
    if (PyTuple_CheckExact(v)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v); ++i)
            if (!plain(PyTuple_GET_ITEM(v, i))) return false;
        return true;
    }
    return PyLong_CheckExact(v) || PyFloat_CheckExact(v) || PyUnicode_CheckExact(v) || PyBool_Check(v) || v == Py_None;
}

// A scalar's word (call_values._scalar_word's exact cases): an exact float as its fp32 bits (a NaN's payload and a
// finite number that rounds to infinity, struct's OverflowError, are Python's to handle), an exact int within int32.
bool scalar_word(PyObject* v, bool is_float, int64_t& word) {
    if (is_float) {
        if (!PyFloat_CheckExact(v)) return false;
        const double x = PyFloat_AS_DOUBLE(v);
        const float f = float(x);
        if (std::isnan(x) || (std::isinf(f) && !std::isinf(x))) return false;
        int32_t bits;
        std::memcpy(&bits, &f, sizeof bits);
        word = bits;
        return true;
    }
    if (!PyLong_CheckExact(v)) return false;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) PyErr_Clear();
    if (overflow != 0 || x < INT32_MIN || x > INT32_MAX) return false;
    word = x;
    return true;
}

struct TensorSlot {
    Place place;
    int64_t rank;
    py::object source;  // a weak reference to the tensor last read, or None: not read yet
    int64_t version = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    at::Tensor passed;  // what the kernel got: its converted copy, or undefined for the source itself
};

// The values of one call (flashgen.mods.KernelMods.pack's order) and its block mask.
struct ModValues {
    std::vector<int64_t> words;
    std::vector<at::Tensor> tensors;
    std::optional<at::Tensor> block_mask;
};

struct ModReader {
    int64_t kernel;  // the kernel built with the mods
    py::object fns[2];  // (weak reference, code) of score_mod and mask_mod, or None
    std::vector<std::pair<Place, py::object>> statics;  // numbers compiled in as literals: same type, equal
    std::vector<std::pair<Place, bool>> scalars;  // is_float
    std::vector<TensorSlot> tensors;
    size_t mask_first, mask_count;  // the mask_mod's scalars among the words
    bool masked;  // a mask_mod: calls take a block mask
    bool forgotten = false;  // a function died (or Python dropped its CallValues): serves nothing
    bool plain_statics = true;  // every literal compares without running Python code (else Python reads every call)
    // the state of the last read through Python
    std::optional<c10::Device> device;
    std::vector<int64_t> mask_words, q_sizes;
    int64_t seq_k = 0;
    at::Tensor block_mask;  // undefined: none made yet

    ModReader(int64_t kernel_, const py::tuple& fns_, const py::list& statics_, const py::list& scalars_,
              const py::list& tensors_, size_t mask_first_, size_t mask_count_, bool masked_)
        : kernel(kernel_), mask_first(mask_first_), mask_count(mask_count_), masked(masked_) {
        kernel_at(kernel, false);
        FG_REQUIRE(fns_.size() == 2, "fns: (score_mod's, mask_mod's)");
        for (size_t i = 0; i < 2; ++i) {
            fns[i] = py::reinterpret_borrow<py::object>(fns_[i]);
            FG_REQUIRE(fns[i].is_none() || (py::isinstance<py::tuple>(fns[i]) && py::len(fns[i]) == 2 &&
                                            PyWeakref_CheckRef(fns[i][py::int_(0)].ptr())),
                       "a function is (weak reference, code) or None");
        }
        for (const auto& s : statics_) {
            statics.emplace_back(Place::of(s[py::int_(0)]), s[py::int_(1)]);
            plain_statics = plain_statics && plain(statics.back().second.ptr());
        }
        for (const auto& s : scalars_) scalars.emplace_back(Place::of(s[py::int_(0)]), s[py::int_(1)].cast<bool>());
        for (const auto& t : tensors_) tensors.push_back({Place::of(t[py::int_(0)]), t[py::int_(1)].cast<int64_t>(), py::none()});
        FG_REQUIRE(mask_first + mask_count <= scalars.size(), "the mask_mod's words lie past the scalars");
    }

    bool serves(const py::handle& fn, size_t i) const {
        if (fns[i].is_none()) return fn.is_none();
        const py::tuple pair = py::reinterpret_borrow<py::tuple>(fns[i]);
        return PyWeakref_GetObject(pair[0].ptr()) == fn.ptr() && PyFunction_Check(fn.ptr()) &&
               PyFunction_GET_CODE(fn.ptr()) == pair[1].ptr();
    }

    // CallValues.read's answer for a call of q's and k's sizes where it comes from this state; false: Python reads
    bool read(const at::Tensor& q, const at::Tensor& k, const py::handle& score_fn, const py::handle& mask_fn,
              ModValues& out) const {
        if (forgotten || !plain_statics || !serves(score_fn, 0) || !serves(mask_fn, 1)) return false;
        for (const auto& [place, value] : statics) {
            const py::object now = place.read();
            if (!now || Py_TYPE(now.ptr()) != Py_TYPE(value.ptr()) || !plain(now.ptr())) return false;
            // `now != value` as Python evaluates it (no identity shortcut: a NaN literal never matches)
            const auto differs = py::reinterpret_steal<py::object>(PyObject_RichCompare(now.ptr(), value.ptr(), Py_NE));
            const int truth = differs ? PyObject_IsTrue(differs.ptr()) : -1;
            if (truth < 0) PyErr_Clear();
            if (truth != 0) return false;
        }
        out.words.resize(scalars.size());
        for (size_t i = 0; i < scalars.size(); ++i) {
            const py::object now = scalars[i].first.read();
            if (!now || !scalar_word(now.ptr(), scalars[i].second, out.words[i])) return false;
        }
        if ((masked || !tensors.empty()) && device != q.device()) return false;
        for (const TensorSlot& slot : tensors) {
            const py::object now = slot.place.read();
            if (!now || slot.source.is_none() || PyWeakref_GetObject(slot.source.ptr()) != now.ptr() ||
                !THPVariable_CheckExact(now.ptr()))
                return false;
            const at::Tensor& t = THPVariable_Unpack(now.ptr());
            if (t.is_inference() || t._version() != slot.version || t.scalar_type() != slot.dtype || t.requires_grad() ||
                t.dim() != slot.rank)
                return false;
            out.tensors.push_back(slot.passed.defined() ? slot.passed : t);
        }
        if (masked) {  // the block mask of these mask words, tensors (the slots') and sizes
            const auto mine = out.words.begin() + ptrdiff_t(mask_first);
            if (!block_mask.defined() || q.sizes() != c10::IntArrayRef(q_sizes) || k.dim() < 2 || k.size(1) != seq_k ||
                !std::equal(mine, mine + ptrdiff_t(mask_count), mask_words.begin(), mask_words.end()))
                return false;
            out.block_mask = block_mask;
        }
        return true;
    }

    // The state a read through Python left: `slots` (source weak reference, version, dtype, copy passed or None) per
    // captured tensor, on `device`; the block mask made for `words_of_mask` and q's and k's sizes (None: no mask_mod).
    void update(const c10::Device& device_, const py::list& slots, const std::vector<int64_t>& words_of_mask,
                const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& block_mask_) {
        if (forgotten) return;
        FG_REQUIRE(slots.size() == tensors.size(), "update: ", tensors.size(), " tensor slots, got ", slots.size());
        FG_REQUIRE(words_of_mask.size() == mask_count, "update: ", mask_count, " mask words, got ", words_of_mask.size());
        FG_REQUIRE(block_mask_.has_value() == masked, "update: a block mask goes with a mask_mod, and only with one");
        for (size_t i = 0; i < tensors.size(); ++i) {  // all checked before any is changed
            const auto s = slots[i].cast<py::tuple>();
            FG_REQUIRE(s.size() == 4 && PyWeakref_CheckRef(s[0].ptr()), "update: a slot is (weakref, version, dtype, copy)");
        }
        for (size_t i = 0; i < tensors.size(); ++i) {
            const auto s = slots[i].cast<py::tuple>();
            TensorSlot& slot = tensors[i];
            slot.source = s[0];
            slot.version = s[1].cast<int64_t>();
            slot.dtype = s[2].cast<c10::ScalarType>();
            slot.passed = s[3].is_none() ? at::Tensor() : s[3].cast<at::Tensor>();
        }
        device = device_;
        mask_words = words_of_mask;
        q_sizes = q.sizes().vec();
        seq_k = k.dim() >= 2 ? k.size(1) : -1;
        block_mask = block_mask_.value_or(at::Tensor());
    }

    // Drop every reference to the functions' cells, their captured tensors, the copies and the block mask.
    void forget() {
        forgotten = true;
        fns[0] = fns[1] = py::none();
        statics.clear();
        scalars.clear();
        tensors.clear();
        block_mask = at::Tensor();
    }

    // The values a call would take (for tests: no device check, no launch), or None
    py::object values(const at::Tensor& q, const at::Tensor& k, const py::object& score_fn, const py::object& mask_fn) const {
        ModValues v;
        if (!read(q, k, score_fn, mask_fn, v)) return py::none();
        return py::make_tuple(v.words, v.tensors, v.block_mask.has_value() ? py::cast(*v.block_mask) : py::none());
    }
};

// call_mods through the reader of `key` in `table` (None where there is none or it does not serve the call).
py::object call_read(int64_t table, const ModKey& key, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const py::object& softmax_scale, int64_t window_left, int64_t window_right, const std::string& align,
                     bool return_lse, const py::object& score_fn, const py::object& mask_fn) {
    table_at(table);
    const auto& readers = mod_tables[size_t(table)];
    const auto hit = readers.find(key);
    if (hit == readers.end()) return py::none();
    const std::shared_ptr<ModReader> held = hit->second;  // whatever the table does meanwhile
    const ModReader& r = *held;
    const Kernel& kn = kernel_at(r.kernel, false);
    if (!device_checked(kn, q)) return py::none();
    if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return py::none();
    ModValues values;
    if (!r.read(q, k, score_fn, mask_fn, values)) return py::none();
    const double scale = softmax_scale.is_none() ? 1.0 / std::sqrt(double(kn.d_head)) : softmax_scale.cast<double>();
    auto [o, lse] = attention_mods(q, k, v, r.kernel, scale, mask_offset(align, q, k), window_left, window_right,
                                   return_lse, values.words, values.tensors, values.block_mask);
    return return_lse ? py::make_tuple(o, lse) : py::cast(o);
}

ModKey mod_key(uint64_t call, const py::object& score_fn, const py::object& mask_fn) {
    return {call, uintptr_t(score_fn.ptr()), uintptr_t(mask_fn.ptr())};
}

// An Attention's repeated call: its table's reader of the function pair.
py::object call_mods_again(int64_t table, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const py::object& softmax_scale, int64_t window_left, int64_t window_right,
                           const std::string& align, bool return_lse, const py::object& score_fn, const py::object& mask_fn) {
    return call_read(table, mod_key(0, score_fn, mask_fn), q, k, v, softmax_scale, window_left, window_right, align,
                     return_lse, score_fn, mask_fn);
}

// compile("auto")'s repeated call: the reader its table holds for q's dispatch key and `mask` and the function pair.
py::object dispatch_mods(int64_t table, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const py::object& softmax_scale, int64_t mask, int64_t window_left, int64_t window_right,
                         const std::string& align, bool return_lse, const py::object& score_fn, const py::object& mask_fn) {
    if (!keyable(q)) return py::none();
    return call_read(table, mod_key(dispatch_key(q, mask), score_fn, mask_fn), q, k, v, softmax_scale, window_left,
                     window_right, align, return_lse, score_fn, mask_fn);
}

// Keep `reader` for the function pair: under q's dispatch key and `mask` (an AutoAttention's table; a q without one,
// not a 4-D CUDA tensor, keeps nothing), or with q None for every call (an Attention's own table).
void remember_mods(int64_t table, const py::object& q, int64_t mask, const py::object& score_fn, const py::object& mask_fn,
                   const std::shared_ptr<ModReader>& reader) {
    table_at(table);
    uint64_t call = 0;
    if (!q.is_none()) {
        const at::Tensor t = q.cast<at::Tensor>();
        if (!keyable(t)) return;
        call = dispatch_key(t, mask);
    }
    auto& readers = mod_tables[size_t(table)];
    if (readers.size() >= kMaxDispatch) readers.clear();
    readers[mod_key(call, score_fn, mask_fn)] = reader;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flashgen's eager entry points (the torch operators are registered by the same library)";
    m.def("call", &call, "attention through kernel `kernel`; None: the device is not checked for it yet");
    m.def("call_mods", &call_mods, "attention through kernel `kernel` built with mods, on their values; None as call");
    m.def("allow_device", &allow_device, "mark CUDA device `index` as checked for kernel `kernel`");
    m.def("new_dispatch_table", &new_dispatch_table, "a new, empty dispatch table");
    m.def("remember", &remember, "dispatch q's (device, dtype, d_head, seq_q) and `mask` to `kernel`");
    m.def("dispatch", &dispatch, "attention through the kernel the table holds for q's key; None: not there yet");
    py::class_<ModReader, std::shared_ptr<ModReader>>(m, "ModReader", "what repeated calls with one score_mod / mask_mod pair read")
        .def(py::init<int64_t, const py::tuple&, const py::list&, const py::list&, const py::list&, size_t, size_t, bool>(),
             py::arg("kernel"), py::arg("fns"), py::arg("statics"), py::arg("scalars"), py::arg("tensors"),
             py::arg("mask_first"), py::arg("mask_count"), py::arg("masked"))
        .def("update", &ModReader::update, "the state a read through Python left")
        .def("forget", &ModReader::forget, "drop every reference; serve nothing from now on")
        .def("values", &ModReader::values, "(words, tensors, block_mask) a call would take, or None: Python reads");
    m.def("remember_mods", &remember_mods, "keep a reader for a function pair (q None: every call of an Attention)");
    m.def("call_mods_again", &call_mods_again, "an Attention's call through its reader of the pair; None: Python's path");
    m.def("dispatch_mods", &dispatch_mods, "compile('auto')'s call through the reader of q's key and the pair; None as above");
}

TORCH_LIBRARY_FRAGMENT(flashgen, m) {
    m.def("load_kernel(str path, str name, str short_form, ScalarType dtype, int d_head, bool backward=False) -> int",
          &load_kernel);
}

// CPU too, so a CPU tensor gets the device check's message rather than "no kernel for CPU".
TORCH_LIBRARY_IMPL(flashgen, CUDA, m) {
    m.impl("attention", &attention);
    m.impl("attention_out", &attention_out);
    m.impl("attention_mods", &attention_mods);
    m.impl("mask_blocks", &mask_blocks);
    m.impl("attention_backward", &attention_backward);
    m.impl("attention_backward_mods", &attention_backward_mods);
}
TORCH_LIBRARY_IMPL(flashgen, CPU, m) {
    m.impl("attention", &attention);
    m.impl("attention_out", &attention_out);
    m.impl("attention_mods", &attention_mods);
    m.impl("mask_blocks", &mask_blocks);
    m.impl("attention_backward", &attention_backward);
    m.impl("attention_backward_mods", &attention_backward_mods);
}
