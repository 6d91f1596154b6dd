"""The JIT: NVRTC, kernel cache, launcher, tensor maps, device facts and compile policy
shared by the FlexAttention path and serving."""
