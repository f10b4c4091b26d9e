"""The CUDA path of the GPU executor: Triton kernels (paged decode attention, fused layer
ops) and decode steps replayed from CUDA graphs."""
