// aserve's one CPU extension: every CPU kernel in one translation unit, so that torch's headers
// are parsed once (aserve/kernels/cpu_extension.py builds and loads it). The headers hold the
// kernels; this file binds the functions Python calls.
//
// Each binding goes through torch::wrap_pybind_function_no_gil, so a TORCH_CHECK failure reaches
// Python as a RuntimeError carrying its message, and the call releases the GIL as torch's own ops
// do: the kernels touch no Python object (arguments are converted before, results after), and
// while the worker thread is in one the engine thread and the asyncio frontend run on (held, a
// request for the GIL would wait out the whole call, or, at the interpreter's switch interval,
// stall the forward between two calls).
#include <torch/extension.h>

// A fixed order (each header includes what it needs itself, so any order would compile).
// clang-format off
#include "simd.h"
#include "sinks.h"
#include "activation.h"
#include "paged_decode.h"
#include "attention_tiles.h"
#include "attention_rows.h"
#include "elementwise.h"
#include "gemm.h"
#include "qgemm.h"
#include "decoder_layer.h"
#include "moe.h"
#include "qmoe.h"
// clang-format on

#define ASERVE_DEF(name) m.def(#name, torch::wrap_pybind_function_no_gil(name), #name)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  ASERVE_DEF(paged_decode);
  ASERVE_DEF(attend_rows);
  ASERVE_DEF(rows_supported);
  ASERVE_DEF(store_kv);
  ASERVE_DEF(rms_norm);
  ASERVE_DEF(rope);
  ASERVE_DEF(silu_and_mul);
  ASERVE_DEF(gelu_tanh_and_mul);
  ASERVE_DEF(swiglu_oai_and_mul);
  ASERVE_DEF(argmax_rows);
  ASERVE_DEF(gemm_supported);
  ASERVE_DEF(gemm_isa);
  ASERVE_DEF(gemm_amx);
  ASERVE_DEF(gemm_pack);
  ASERVE_DEF(gemm_linear);
  ASERVE_DEF(qgemm_supported);
  ASERVE_DEF(qgemm_isa);
  ASERVE_DEF(qgemm_pack);
  ASERVE_DEF(qgemm_rows);
  ASERVE_DEF(qgemm_linear);
  ASERVE_DEF(decoder_layer);
  ASERVE_DEF(fused_moe);
  ASERVE_DEF(qfused_moe);
  // A class, so its method cannot go through wrap_pybind_function_no_gil: the GIL is released
  // the same way, and a TORCH_CHECK failure reaches Python as a RuntimeError.
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>,
                    std::vector<double>, std::vector<double>, std::vector<double>>())
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
}
