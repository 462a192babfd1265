"""How pagedkv runs its Mojo ops: one concept per module.

- paths.py: the cache directory and the Mojo kernel package.
- contract.py: every code an op and its Python caller share (layouts,
  formats, parameters, op names): one home on this side.
- tensors.py: NumPy arrays and torch tensors as MAX buffers, devices.
- compile_cache.py: compiled MAX models kept on disk, named by what built them.
- kernels.py: building the kernel package and running ops from Python.

Imports point down this list and not into the API above it (compile_cache
only reads graphs/' sources for its digest).
"""
