"""``flashinfer.jit.attention``: FlashInfer's attention module generators.

Each returns a `JitSpec` that `build_jit_specs` accepts and ignores: pagedkv
compiles the MAX op a call needs the first time it runs.
"""

from __future__ import annotations

from .. import module_generator as _generator

gen_single_decode_module = _generator("gen_single_decode_module")
gen_single_prefill_module = _generator("gen_single_prefill_module")
gen_batch_decode_module = _generator("gen_batch_decode_module")
gen_batch_prefill_module = _generator("gen_batch_prefill_module")
gen_batch_mla_module = _generator("gen_batch_mla_module")
gen_pod_module = _generator("gen_pod_module")
gen_batch_pod_module = _generator("gen_batch_pod_module")
gen_batch_prefill_attention_sink_module = _generator("gen_batch_prefill_attention_sink_module")
