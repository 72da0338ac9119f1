// Storage addresses of many tensors, compared with those seen before, in one pass: what a replay of a captured
// CUDA graph needs unchanged (flashdist/optim/graph.py). In Python the same check costs two attribute or method calls
// per tensor (a few hundred nanoseconds each); here a few nanoseconds.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

int64_t address(const at::Tensor& t) {
  if (!t.defined()) return 0;
  // a tensor subclass without data of its own (a DTensor: no storage, or an empty one): the caller reads its
  // local tensor instead
  TORCH_CHECK(t.has_storage() && (t.numel() == 0 || t.data_ptr() != nullptr),
              "flashdist: a tensor without data of its own (a DTensor?)");
  return reinterpret_cast<int64_t>(t.data_ptr());
}

// Whether the address of any tensor of `tensors` (a list of tensors or None; with `grads`, the .grad of each)
// differs from `seen` (int64 on the CPU, one per tensor; 0 for None or no gradient), writing the new ones.
bool addresses_changed(py::list tensors, bool grads, at::Tensor seen) {
  PyObject* list = tensors.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  TORCH_CHECK(seen.device().is_cpu() && seen.scalar_type() == at::kLong && seen.is_contiguous() && seen.numel() == n,
              "flashdist: seen must be a contiguous int64 CPU tensor of one value per tensor");
  int64_t* out = seen.data_ptr<int64_t>();
  bool changed = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(list, i);
    int64_t a = 0;
    if (obj != Py_None) {
      TORCH_CHECK(THPVariable_Check(obj), "flashdist: item ", i, " is not a tensor");
      const at::Tensor& t = THPVariable_Unpack(obj);
      a = grads ? address(t.grad()) : address(t);
    }
    if (out[i] != a) {
      out[i] = a;
      changed = true;
    }
  }
  return changed;
}

// The gradients of `params` (a list of tensors) as a captured step's tables need them: each gradient's address,
// dtype (the ScalarType's number) and numel written into the int64 CPU tensors `addresses`, `dtypes`, `numels`
// (one value per parameter). False, at the first that does not qualify, where a parameter has no gradient,
// or its gradient is not contiguous or not on the parameter's device (the caller then checks in Python, to
// say which one and why).
bool grad_info(py::list params, at::Tensor addresses, at::Tensor dtypes, at::Tensor numels) {
  PyObject* list = params.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  for (const at::Tensor* out : {&addresses, &dtypes, &numels}) {
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == at::kLong && out->is_contiguous() && out->numel() == n,
                "flashdist: addresses, dtypes and numels must be contiguous int64 CPU tensors of one value per tensor");
  }
  int64_t* a = addresses.data_ptr<int64_t>();
  int64_t* d = dtypes.data_ptr<int64_t>();
  int64_t* m = numels.data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(list, i);
    TORCH_CHECK(THPVariable_Check(obj), "flashdist: item ", i, " is not a tensor");
    const at::Tensor& t = THPVariable_Unpack(obj);
    const at::Tensor& g = t.grad();
    if (!g.defined()) return false;
    a[i] = address(g);
    if (!g.is_contiguous() || g.device() != t.device()) return false;
    d[i] = static_cast<int64_t>(g.scalar_type());
    m[i] = g.numel();
  }
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("addresses_changed", &addresses_changed, "compare and record the storage addresses of tensors or their grads");
  m.def("grad_info", &grad_info, "the address, dtype and numel of each parameter's gradient, if all qualify");
}
