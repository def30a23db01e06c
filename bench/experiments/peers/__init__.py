"""pdserve against vLLM's CPU build: ``compare.py`` runs both, ``mbu.py`` turns a batch-1 TPOT
into memory-bandwidth utilisation, ``setup_vllm.sh`` installs vLLM in a venv of its own."""
