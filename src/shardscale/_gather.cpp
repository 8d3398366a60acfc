// shardscale: the common case of bucketing an optimizer's CPU gradients, in C++.
//
// One call does what _grads.bucket_grads' fast path does in Python for every parameter of
// every param group (param.grad; its type, device, layout, dtype, numel, layout in memory,
// address) by reading the tensors directly, and fills the compiled kernel's pointer and length
// arrays. Right after a backward pass has streamed through the caches the Python loop costs
// ~5-7 us per parameter (the interpreter's own state is cold); this costs ~1-2.
//
// It handles only that common case and answers None for anything else (a parameter listed
// twice or not a plain nn.Parameter, a gradient that is not a plain CPU strided tensor of a
// dtype the kernel has a path for, any error): the caller then runs the Python path, which
// handles and validates every case. Reading param.grad here skips Python's attribute getter,
// which differs from it only under a __torch_function__ mode: the caller checks there is none.
//
// shardscale_gather_unscale goes one step further for the commonest case (one dtype, every
// gradient dense and aligned): it gathers and then runs the compiled unscale kernel itself
// (by address, with the GIL released while it runs), so a CPU unscale_ is one call.
//
// Called through ctypes.PyDLL: the GIL is held (but around that kernel).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kCodes = 3;  // float32, bfloat16, float16: _cpukernel._CODES

int code_of(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::BFloat16: return 1;
    case c10::ScalarType::Half: return 2;
    default: return -1;
  }
}

struct Bucket {
  std::vector<PyObject*> taken, rest;  // new references
  std::vector<int64_t> ptrs, lens;
  long long small_left = 0;
  bool seen = false;
};

// New references to the parameters for the duration of a call: creating a gradient's Python
// object can run the garbage collector, whose finalizers could edit the param groups.
struct Held {
  std::vector<PyObject*> objs;
  ~Held() {
    for (PyObject* o : objs) Py_DECREF(o);
  }
};

void release(Bucket (&b)[kCodes]) {
  for (auto& bk : b) {
    for (PyObject* o : bk.taken) Py_DECREF(o);
    for (PyObject* o : bk.rest) Py_DECREF(o);
    bk.taken.clear();
    bk.rest.clear();
  }
}

PyObject* as_list(std::vector<PyObject*>& items) {  // steals the references
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < items.size(); ++i) PyList_SET_ITEM(list, i, items[i]);
  items.clear();
  return list;
}

PyObject* as_array(PyObject* array_type, const std::vector<int64_t>& v) {
  // (an empty vector's data() may be null, which "y#" would turn into None)
  const char* bytes = v.empty() ? "" : reinterpret_cast<const char*>(v.data());
  return PyObject_CallFunction(array_type, "sy#", "q", bytes,
                               static_cast<Py_ssize_t>(v.size() * sizeof(int64_t)));
}

// Every parameter of every param group, as new references in held (in order). false: not the
// common case (not exactly a list of dicts with exactly a list under "params", or a parameter
// that is not exactly nn.Parameter).
bool list_params(PyObject* groups, PyObject* param_type, Held& held) {
  static PyObject* key = PyUnicode_InternFromString("params");
  // exact types only: a subclass's own __getitem__/__iter__ would be bypassed by the C API
  if (!key || !PyList_CheckExact(groups)) return false;
  std::vector<PyObject*>& params = held.objs;
  for (Py_ssize_t gi = 0; gi < PyList_GET_SIZE(groups); ++gi) {
    PyObject* group = PyList_GET_ITEM(groups, gi);
    PyObject* list = PyDict_CheckExact(group) ? PyDict_GetItemWithError(group, key) : nullptr;
    if (!list || !PyList_CheckExact(list)) return false;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
      PyObject* p = PyList_GET_ITEM(list, i);
      if (reinterpret_cast<PyObject*>(Py_TYPE(p)) != param_type) return false;
      Py_INCREF(p);
      params.push_back(p);
    }
  }
  return true;
}

// No parameter listed twice (the Python path takes a tied weight listed twice once).
bool listed_once(const std::vector<PyObject*>& params) {
  std::vector<PyObject*> sorted(params);
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

// The address of a gradient the kernel takes (dense: contiguous, or channels-last 2d/3d; and
// aligned to its element size), else 0 (torch's kernel takes it).
int64_t kernel_address(const at::Tensor& grad, int code) {
  static const int esize[kCodes] = {4, 2, 2};
  int64_t dim = grad.dim();
  bool dense = grad.is_contiguous() ||
               (dim == 4 && grad.is_contiguous(c10::MemoryFormat::ChannelsLast)) ||
               (dim == 5 && grad.is_contiguous(c10::MemoryFormat::ChannelsLast3d));
  if (!dense) return 0;
  auto ptr = reinterpret_cast<intptr_t>(grad.data_ptr());
  return ptr % esize[code] == 0 ? static_cast<int64_t>(ptr) : 0;
}

// false: not the common case (the caller takes the Python path).
bool gather(PyObject* groups, PyObject* param_type, PyObject* tensor_type, long long codes,
            long long small, long long small_cap, Bucket (&b)[kCodes], int* order, int* norder,
            Held& held) {
  if (!list_params(groups, param_type, held)) return false;
  const std::vector<PyObject*>& params = held.objs;
  for (PyObject* p : params) {
    const at::Tensor grad = THPVariable_Unpack(p).grad();  // held: see Held
    if (!grad.defined()) continue;
    if (!grad.is_cpu() || grad.layout() != c10::kStrided) return false;
    int code = code_of(grad.scalar_type());
    if (code < 0 || !(codes >> code & 1)) return false;
    int64_t numel = grad.numel();
    if (numel == 0) continue;
    PyObject* obj = THPVariable_Wrap(grad);  // the gradient's Python object, as .grad gives
    if (!obj) return false;
    Bucket& bk = b[code];
    if (!bk.seen) {
      bk.seen = true;
      bk.small_left = small_cap;
      order[(*norder)++] = code;
    }
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != tensor_type) {  // a subclass
      Py_DECREF(obj);
      return false;
    }
    bool take = false;
    if (numel >= small || bk.small_left) {
      int64_t ptr = kernel_address(grad, code);
      take = ptr != 0;
      if (take) {
        if (numel < small && bk.small_left > 0) bk.small_left--;
        bk.ptrs.push_back(ptr);
        bk.lens.push_back(numel);
      }
    }
    (take ? bk.taken : bk.rest).push_back(obj);
  }
  // a parameter listed twice: the Python path keeps the first (checked last, so that a model
  // on an accelerator is turned away at its first gradient, before this sort)
  return listed_once(params);
}

}  // namespace

// ctx: (nn.Parameter, torch.Tensor, array.array). codes: bit c set if the kernel has a path for
// dtype code c. small/small_cap: _cpukernel._SMALL/_SMALL_CAP. Returns None (take the Python
// path), or a list of (code, taken, ptrs, lens, rest, small_left) per dtype, in the order the
// dtypes first appear (an empty list: no gradients).
extern "C" PyObject* shardscale_gather(PyObject* groups, PyObject* ctx, long long codes,
                                       long long small, long long small_cap) {
  Bucket b[kCodes];
  int order[kCodes], norder = 0;
  PyObject* result = nullptr;
  Held held;
  try {
    if (PyTuple_Check(ctx) && PyTuple_GET_SIZE(ctx) == 3 &&
        gather(groups, PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1), codes, small,
               small_cap, b, order, &norder, held)) {
      PyObject* array_type = PyTuple_GET_ITEM(ctx, 2);
      result = PyList_New(norder);
      for (int j = 0; result && j < norder; ++j) {
        Bucket& bk = b[order[j]];
        PyObject *ptrs = as_array(array_type, bk.ptrs), *lens = as_array(array_type, bk.lens);
        PyObject *taken = as_list(bk.taken), *rest = as_list(bk.rest);
        PyObject* item = ptrs && lens && taken && rest
                             ? Py_BuildValue("(iOOOOL)", order[j], taken, ptrs, lens, rest,
                                             bk.small_left)
                             : nullptr;
        Py_XDECREF(ptrs);
        Py_XDECREF(lens);
        Py_XDECREF(taken);
        Py_XDECREF(rest);
        if (!item) Py_CLEAR(result);
        else PyList_SET_ITEM(result, j, item);
      }
    }
  } catch (...) {  // a tensor without storage, out of memory: the Python path says what is wrong
    Py_CLEAR(result);
  }
  release(b);
  if (result) return result;
  PyErr_Clear();
  Py_RETURN_NONE;
}

// ------------------------------------------------------------------ gather and unscale at once
namespace {

// A tensor's Python object if it has one, read without making one: nullptr if it has none (the
// autograd engine makes gradients in C++; such a tensor is a plain torch.Tensor, and a Python
// subclass's object lives as long as its tensor). kUnknown where this torch's PyObjectSlot has
// no load_pyobj() (older versions): the caller then asks THPVariable_Wrap.
PyObject* const kUnknown = reinterpret_cast<PyObject*>(1);

template <class Impl>
auto existing_pyobj(Impl* impl, int) -> decltype(impl->pyobj_slot()->load_pyobj()) {
  return impl->pyobj_slot()->load_pyobj();
}

template <class Impl>
PyObject* existing_pyobj(Impl*, long) {
  return kUnknown;
}

// Whether a gradient is a plain torch.Tensor (not a Python subclass).
bool plain_tensor(const at::Tensor& grad, PyObject* tensor_type) {
  PyObject* obj = existing_pyobj(grad.unsafeGetTensorImpl(), 0);
  if (obj != kUnknown) return !obj || reinterpret_cast<PyObject*>(Py_TYPE(obj)) == tensor_type;
  obj = THPVariable_Wrap(grad);
  if (!obj) return false;
  bool plain = reinterpret_cast<PyObject*>(Py_TYPE(obj)) == tensor_type;
  Py_DECREF(obj);
  return plain;
}

// The address of a plain float32 CPU tensor's one element (a found-inf flag, a factor), else
// nullptr: as _cpukernel._scalar_ptr.
float* scalar_ptr(PyObject* obj, PyObject* tensor_type) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != tensor_type) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.is_cpu() || t.layout() != c10::kStrided ||
      t.scalar_type() != c10::ScalarType::Float || t.numel() != 1)
    return nullptr;
  return static_cast<float*>(t.data_ptr());
}

using UnscalePacked = int (*)(const int64_t*);

int gather_unscale(PyObject* groups, PyObject* ctx, PyObject* found_inf, PyObject* inv_scale) {
  if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 4) return -1;
  PyObject* param_type = PyTuple_GET_ITEM(ctx, 0);
  PyObject* tensor_type = PyTuple_GET_ITEM(ctx, 1);
  long long codes = PyLong_AsLongLong(PyTuple_GET_ITEM(ctx, 2));
  auto kernel = reinterpret_cast<UnscalePacked>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(ctx, 3)));
  float* flag = scalar_ptr(found_inf, tensor_type);
  float* inv = scalar_ptr(inv_scale, tensor_type);
  if (PyErr_Occurred() || !kernel || !flag || !inv) return -1;
  Held held;
  if (!list_params(groups, param_type, held)) return -1;
  std::vector<at::Tensor> grads;  // held while the kernel runs
  std::vector<int64_t> ptrs, lens;
  int code = -1;
  for (PyObject* p : held.objs) {
    at::Tensor grad = THPVariable_Unpack(p).grad();
    if (!grad.defined()) continue;
    if (!grad.is_cpu() || grad.layout() != c10::kStrided) return -1;
    int c = code_of(grad.scalar_type());
    if (c < 0 || !(codes >> c & 1) || (code >= 0 && c != code)) return -1;  // one dtype only
    code = c;
    int64_t numel = grad.numel();
    if (numel == 0) continue;
    if (!plain_tensor(grad, tensor_type)) return -1;
    int64_t ptr = kernel_address(grad, c);
    if (!ptr) return -1;  // torch's kernel takes it: the Python path
    ptrs.push_back(ptr);
    lens.push_back(numel);
    grads.push_back(std::move(grad));
  }
  if (!listed_once(held.objs)) return -1;
  if (ptrs.empty()) return 1;
  const int64_t args[7] = {reinterpret_cast<int64_t>(ptrs.data()),
                           reinterpret_cast<int64_t>(lens.data()),
                           static_cast<int64_t>(ptrs.size()),
                           code,
                           reinterpret_cast<int64_t>(inv),
                           reinterpret_cast<int64_t>(flag),
                           at::get_num_threads()};
  int rc;
  Py_BEGIN_ALLOW_THREADS  // as a ctypes.CDLL call of the kernel: other Python threads run
  rc = kernel(args);
  Py_END_ALLOW_THREADS
  return rc == 0 ? 0 : -1;  // refused (overlapping memory) or out of memory: nothing written
}

}  // namespace

// bucket_grads and the kernel's unscale in one call, for the common case with one dtype and
// every gradient the kernel's (plain, dense, aligned; no small-tensor cap: there is no Python
// per tensor to save). ctx: (nn.Parameter, torch.Tensor, codes bit mask, the address of
// _cpukernel.c's shardscale_unscale_packed). found_inf, inv_scale: plain float32 CPU tensors of
// one element. Returns 0: unscaled (found_inf set to 1.0 if a value was inf or NaN), 1: no
// gradient (nothing done), -1: not the common case, nothing written (the Python path).
extern "C" int shardscale_gather_unscale(PyObject* groups, PyObject* ctx, PyObject* found_inf,
                                         PyObject* inv_scale) {
  int rc;
  try {
    rc = gather_unscale(groups, ctx, found_inf, inv_scale);
  } catch (...) {  // a tensor without storage, out of memory: the Python path says what is wrong
    rc = -1;
  }
  if (rc < 0) PyErr_Clear();
  return rc;
}
