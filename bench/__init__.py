"""``pdserve bench``: a TTFT/TPOT benchmark client for any OpenAI-compatible server.

A client only: nothing in this folder's own modules imports torch or the serving packages.
The scripts beside it are not part of the client: ``experiments/`` start a cluster and drive
it, ``micro/`` measure one component in process; ``results/`` holds the committed figures.

    datasets.py / prompts.py   what to send          arrivals.py   when to send it
    client.py                  one streamed request  runner.py     one timed run
    multi_turn.py              conversations         metrics.py    vLLM's definitions
    report.py                  console table, JSON   sweep.py      rates, best rate
    plots.py                   PNG charts            harness.py    the run as a whole
    cli.py                     the subcommand
"""
