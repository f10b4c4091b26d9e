// Python bindings of executor_gpu's CPU kernels (see kernels.h).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &tandem::paged_attention,
        "Causal attention of a step's query tokens over a paged float32 or bf16 KV cache, "
        "optionally storing their keys and values first",
        pybind11::arg("query"), pybind11::arg("new_key"), pybind11::arg("new_value"),
        pybind11::arg("slots"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("query_start_loc"), pybind11::arg("scale"),
        pybind11::arg("bf16_dot") = false);
  m.def("paged_attention_supports", &tandem::paged_attention_supports,
        "Whether paged_attention takes heads of this size");
  m.def("pack_linear_weight", &tandem::pack_linear_weight,
        "[in, out] weight -> column panels [out / 64, in, 64] for packed_linear, or with "
        "pairs (bf16) [out / 64, in / 2, 64, 2] for its AVX-512 bf16 dot products",
        pybind11::arg("weight"), pybind11::arg("pairs") = false);
  m.def("bf16_dot_supported", &tandem::bf16_dot_supported,
        "Whether this CPU has the AVX-512 bf16 dot products (cpuid)");
  m.def("packed_linear", &tandem::packed_linear, "x @ weight (+ bias), weight packed",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"));
  m.attr("PANEL") = tandem::kPanel;
  m.def("task_pool_stats", &tandem::task_pool_stats,
        "[helper threads started, jobs offered to helpers, helper runs of those jobs]");
  m.def("scan_logits", &tandem::scan_logits,
        "(argmax int64 [rows], finite bool [rows]) of float32 logits [rows, vocab] in one pass");
  m.def("rms_norm", &tandem::rms_norm, "RMSNorm of the rows of x times weight");
  m.def("add_rms_norm_", &tandem::add_rms_norm_,
        "residual += x in place, then RMSNorm of residual times weight");
  m.def("rotary_", &tandem::rotary_,
        "Rotate the first num_heads heads of each token in place (half-split RoPE)");
  m.def("decoder_stack", &tandem::decoder_stack,
        "Every decoder layer and the final norm of a Llama-family model over a step's "
        "embeddings (the GIL released)",
        pybind11::arg("x"), pybind11::arg("layers"), pybind11::arg("final_norm"),
        pybind11::arg("positions"), pybind11::arg("cos_sin"), pybind11::arg("slots"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("query_start_loc"), pybind11::arg("num_heads"),
        pybind11::arg("num_kv_heads"), pybind11::arg("eps"), pybind11::arg("scale"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("DECODER_STACK_TENSORS_PER_LAYER") = tandem::decoder_stack_tensors_per_layer();
  m.def("silu_and_mul", &tandem::silu_and_mul, "silu(gate) * up of gate|up rows");
}
