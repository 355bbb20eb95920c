"""Calibration tooling: everything that makes a calibration, which :mod:`kernelsight.simcore` only evaluates.

:mod:`.fit` holds the pure fitting and cross-generation transfer code (numpy, no I/O); :mod:`.rows` maps measured
rows to the step model's kernels and prices them under a calibration; the rest reads and writes files, runs the
microbenchmark sweep and wires the CLI.
"""
