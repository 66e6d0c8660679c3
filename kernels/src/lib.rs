//! CubeCL kernels for kimi-burn.
