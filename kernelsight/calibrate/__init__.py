"""Calibration tooling (I/O side): read measurement files, run the microbenchmark sweep, CLI wiring.

The pure fitting and transfer code lives in :mod:`kernelsight.simcore.eta_fit` and
:mod:`kernelsight.simcore.eta_transfer`; this package only reads/writes files and parses arguments.
"""
