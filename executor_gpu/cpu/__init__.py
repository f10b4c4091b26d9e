"""The CPU path of the GPU executor: C++ kernels (paged attention, fused layer ops, packed
linear layers, the whole decoder stack in one call) built once with torch's extension loader."""
