"""pdserve against vLLM's CPU build and llama.cpp's server: ``compare.py`` runs them
(``servers.py`` starts each, ``report.py`` writes the table and plot), ``mbu.py`` turns a
batch-1 TPOT into memory-bandwidth utilisation, ``setup_vllm.sh`` installs vLLM in a venv of
its own, ``setup_llamacpp.sh`` builds ``llama-server`` from llama-cpp-python's sdist."""
