// The Python module `bagua_core`: the runtime's types and functions, bound
// one layer per unit (see bindings.h), with the test-only hooks apart in
// `bagua_core._testing`.
#include "bindings.h"

PYBIND11_MODULE(bagua_core, m) {
  namespace bp = bagua::python;
  m.doc() = "bagua runtime: communicators, buckets, comm ops and the scheduler";
  bp::bind_core(m);  // first: the exception classes every other unit's errors map to
  bp::bind_comm(m);
  bp::bind_ops(m);
  bp::bind_backend(m);
  bp::bind_bluefog(m);
  bp::bind_ripples(m);

  auto testing =
      m.def_submodule("_testing",
                      "Hooks for tests and benchmarks (raw kernels, pools, in-process store); "
                      "not part of the runtime's API");
  bp::bind_testing(testing);
  // Importable as a module too: `from bagua_core._testing import ...`.
  pybind11::module_::import("sys").attr("modules")["bagua_core._testing"] = testing;
}
