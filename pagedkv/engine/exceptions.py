"""The error of a request the engine refuses. Mirrors ``vllm/exceptions.py``."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (a 400 for the server); ``parameter`` names the field at fault. Mirrors
    ``VLLMValidationError`` (``vllm/exceptions.py``): vLLM's server reports its ``parameter`` as the error's
    ``param``, and a plain ``ValueError`` with ``param: null``."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter
