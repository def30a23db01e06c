"""A discrete-event model of a pdserve cluster, for sizing at scales nobody can run here.

Pure Python (no torch): the coordinator's own policy objects (placement, conditional
disaggregation, admission) decide; workers' steps take the times a ``Profile`` says (measured
by ``pdserve profile``, or derived from a model's shape and a device's figures:
``sim/derive.py``). ``pdserve plan`` (launch/plan.py) searches layouts with it.

    request.py    what a simulated request is (``SimRequest``)
    workload.py   reading a workload: a JSON spec, a compact string or a trace (trace.py);
                  spec.py draws its requests (rates, bursts; lengths.py: length
                  distributions; patterns.py: bursts, multi-turn, shared prefixes, tiers)
    devices.py    devices' figures; shapes.py: models' shapes; derive.py: roofline profiles
    events.py     the event loop
    steps.py      a step's time from a profile; cache.py: a worker's prefix cache
    prefill.py    a prefill worker; decode.py: a decode (or colocated) worker; seq.py: the
                  state a request carries through them
    config.py     layouts and the workers' settings
    cluster.py    the gateway's admission, the coordinator's placement, KV transfer links
    results.py    TTFT / TPOT / ITL percentiles and goodput of a run
    search.py     the layout search ``pdserve plan`` runs
    calibrate.py  a profile scaled to a host's speed of the day (checking against real runs:
                  bench/experiments/sim_validate.py)
"""
