"""Joining a Ray cluster for the fan-outs that take ``--ray-address`` (``simulate --replicas``, ``plan``).

Ray is imported only here and only when an address is given: the single-machine paths need nothing beyond the
standard library (``pip install 'kernelsight[cluster]'`` adds Ray).
"""

from __future__ import annotations

from typing import Any

__all__ = ["connect_ray"]


def connect_ray(address: str, local_cpus: int) -> Any:
    """The ``ray`` module, initialised on ``address`` (``auto``, ``ray://HOST:10001``, or ``local``: a Ray instance
    started in this process with ``local_cpus`` CPUs). A Ray already initialised in this process is used as it is."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray-address needs Ray: pip install 'kernelsight[cluster]' (or pip install ray)") from None
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": False}
        if address == "local":
            kwargs["num_cpus"] = max(1, local_cpus)
        else:
            kwargs["address"] = address
        ray.init(**kwargs)
    return ray
