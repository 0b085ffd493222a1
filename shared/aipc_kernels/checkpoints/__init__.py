"""Readers of published quantized checkpoints, each re-laying its blocks out exactly onto the kernel
layer's format: GGUF (``gguf``), GPTQ / AutoGPTQ (``gptq``), BitNet (``bitnet``), and the detection of a
checkpoint's grid (``grid_detect``)."""
