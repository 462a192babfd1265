"""``flashinfer.cute_dsl``: FlashInfer's CuTe DSL kernels, which pagedkv does
not have (`utils.is_cute_dsl_arch_supported` says so)."""
