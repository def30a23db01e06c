"""Micro-benchmarks: one component at a time, in process (scripts, run from the repository root
as ``.venv/bin/python bench/micro/NAME.py``; never part of ``make test``).

    engine.py          offline throughput: the engine against ``transformers.generate``
    structured.py      what a JSON Schema constraint costs a decode step
    cpu_attention.py   CPU decode attention: the C kernel against the torch path
    gateway_tokens.py  the gateway's cost a token, ZMQ frame to SSE string
    kv_curve.py        KV transfer MB/s between two processes: zmq, zmq + CURVE, nixl
    gpu.py             every GPU check and benchmark in one table (``gpu_attention.py``,
                       ``gpu_model.py``, ``gpu_serving.py`` hold its rows)
"""
