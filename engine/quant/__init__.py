"""Weight-only quantized linear layers (CPU): int8 and int4 made at load, GGUF blocks kept."""
