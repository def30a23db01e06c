"""Experiments: scripts that start ``pdserve serve`` (``cluster.py``) and drive it with the
``pdserve bench`` client or their own load, run from the repository root as
``.venv/bin/python bench/experiments/NAME.py``; the committed figures are in ``bench/results/``.

    disagg_vs_colocated.py  disaggregated against colocated, the ``mixed`` workload
    kv_routing.py           KV-aware against load routing, multi-turn (``kv_routing_report.py``)
    peers/compare.py        pdserve against vLLM's CPU build and llama.cpp on the same cores
    overhead.py             the serving path's cost against the in-process engine
    soak.py                 a bounded run with faults: hung requests and leaked blocks
    tp_speed.py             tensor parallelism: TP 2 against one process (a 1B-shape model)
    spec_speed.py           speculative decoding: off, n-gram, an int4 draft; copy and chat
    sim_validate.py         the simulator (sim/) replaying the committed runs (no server)
"""
