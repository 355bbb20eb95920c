"""Fitting calibrations: η models, residual corrections, collective curves and cross-generation transfer.

Pure numpy, no file I/O. What is fitted here, :mod:`kernelsight.simcore` only evaluates:

* :mod:`.eta` — a whole GPU's calibration from its measurement tables (per family, variant and kernel);
* :mod:`.logpoly` — the smooth η of one sub-model (:class:`~kernelsight.simcore.eta.LogPolyEta`);
* :mod:`.lattice` — the target tier's residual lattice; :mod:`.residual_trees` — its boosted trees;
* :mod:`.dispatch` — which kernel vLLM runs for a shape, learned from measured rows;
* :mod:`.comm` — collective latency curves, measured and transferred;
* :mod:`.transfer` — the cross-generation tier: a calibration for a GPU nobody measured.
"""
