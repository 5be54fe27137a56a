"""Native kernels for Kiln's training engine: Cython (CPU) and, later, the CUDA library."""
