"""``pdserve bench``: a TTFT/TPOT benchmark client for any OpenAI-compatible server.

A client only: nothing here imports torch or the serving packages (``engine.py``,
``overhead.py`` and ``soak.py`` are scripts of their own, not part of the harness).

    datasets.py / prompts.py   what to send          arrivals.py   when to send it
    client.py                  one streamed request  runner.py     one timed run
    metrics.py                 vLLM's definitions    report.py     console table, JSON
    sweep.py                   rates, best rate      plots.py      PNG charts
    cli.py                     the subcommand
"""
