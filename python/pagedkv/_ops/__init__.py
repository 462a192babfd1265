"""How pagedkv runs its Mojo ops: one concept per module.

- paths.py: the cache directory and the Mojo kernel package.
- contract.py: every code an op and its Python caller share (layouts,
  formats, parameters, op names): one home on this side.
- tensors.py: NumPy arrays and torch tensors as MAX buffers, devices.
- cpu_target.py: the CPU the kernels compile for (PAGEDKV_CPU_TARGET) and a
  probe of the branches a compile took.
- compile_cache.py: compiled MAX models kept on disk, named by what built them.
- kernels.py: building the kernel package and running ops from Python.

Imports point down this list and not into the API above it (compile_cache
only reads graphs/' sources for its digest).
"""
