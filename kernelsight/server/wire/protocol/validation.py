"""``VLLMValidationError``: a request-model check that names its parameter (below the request models, which
raise it)."""

from __future__ import annotations


class VLLMValidationError(ValueError):
    """A request-model check that names the offending parameter (reported as the error's ``param``)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter
