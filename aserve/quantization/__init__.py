"""Quantized checkpoints: GGUF files made into model directories (`gguf_file.py`, torch-free;
their tokenizer: `gguf_tokenizer.py`) and the torch reference dequantization of the GGUF (GGML)
quant types (`gguf_quants.py`), the twin that quantized kernels are tested against and that the
GGUF float loader reads weights with. Import the modules themselves: this package imports
nothing, so the engine's arguments can check for a GGUF without importing torch."""
