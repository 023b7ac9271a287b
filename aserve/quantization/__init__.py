"""Quantized checkpoints: GGUF files made into model directories (`gguf_file.py`, torch-free;
their tokenizer: `gguf_tokenizer.py`) and the torch reference dequantization of the GGUF (GGML)
quant types (`gguf_quants.py`), the twin that quantized kernels are tested against and that the
GGUF float loader reads weights with. Import the modules themselves: this package imports
nothing, so the engine's arguments can check for a GGUF without importing torch."""

# --quantization's names, as vLLM's: the methods aserve reads, and vLLM's kernel-specific
# aliases of them (what each means: `QUANTIZATION_ALIASES`)
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "marlin": "gptq",
                        "compressed_tensors": "compressed-tensors"}
QUANTIZATION_NAMES = ("gguf", "gptq", "awq", "compressed-tensors", "fp8",
                      *QUANTIZATION_ALIASES)
