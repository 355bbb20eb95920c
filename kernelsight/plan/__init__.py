"""``kernelsight plan``: capacity planning — search deployments (GPU, TP, replicas, batch limits, formats) for the
cheapest one that meets a latency SLO at a given load, with the Pareto front of cost vs goodput.

Each simulated point goes through the fast-forward driver (``loadgen.fastforward.run_replicas``), the same path
``kernelsight simulate`` takes, so a chosen deployment re-run with ``simulate`` gives the same numbers.
"""
