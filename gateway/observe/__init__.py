"""What the gateway exposes of the cluster on ``/metrics`` and ``/planner``, beside its own
request metrics (``gateway.metrics``):

    prometheus.py    the text format: counters, gauges, histograms and their registry
    step_metrics.py  each worker's steps (their time, tokens and budget)
    spec_metrics.py  speculative decoding's proposals and acceptance
    planning.py      the planner's plans and the latencies gateways sample for it
"""
