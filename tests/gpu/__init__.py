"""GPU tests (marker `gpu`; scripts/gpu_check.sh runs them on the H200): fresh random inputs,
poisoned outputs, the fp64 reference. NVRTC-only checks live with the runtime tests."""
