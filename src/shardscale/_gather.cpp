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
// Called through ctypes.PyDLL: the GIL is held throughout.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

// false: not the common case (the caller takes the Python path).
bool gather(PyObject* groups, PyObject* param_type, PyObject* tensor_type, long long codes,
            long long small, long long small_cap, Bucket (&b)[kCodes], int* order, int* norder,
            Held& held) {
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
  static const int esize[kCodes] = {4, 2, 2};
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
      int64_t dim = grad.dim();
      bool dense = grad.is_contiguous() ||
                   (dim == 4 && grad.is_contiguous(c10::MemoryFormat::ChannelsLast)) ||
                   (dim == 5 && grad.is_contiguous(c10::MemoryFormat::ChannelsLast3d));
      if (dense) {
        auto ptr = reinterpret_cast<intptr_t>(grad.data_ptr());
        take = ptr && ptr % esize[code] == 0;
        if (take) {
          if (numel < small && bk.small_left > 0) bk.small_left--;
          bk.ptrs.push_back(static_cast<int64_t>(ptr));
          bk.lens.push_back(numel);
        }
      }
    }
    (take ? bk.taken : bk.rest).push_back(obj);
  }
  // a parameter listed twice: the Python path keeps the first (checked last, so that a model
  // on an accelerator is turned away at its first gradient, before this sort)
  std::vector<PyObject*> sorted(params);
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
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
