// cuda backend of the neutral gpu:: API (placeholder until csrc/gpu/gpu.h lands).
