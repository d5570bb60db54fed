"""The package's user-facing errors: each says what is wrong and how to fix it."""

from __future__ import annotations

from typing import Any


class OrcaInputError(ValueError):
    """Input data or options that cannot be used, with a message saying how to fix it."""


class ConfigError(OrcaInputError):
    """An invalid option value. ``option`` is the :class:`~orca_sc.OrcaConfig` (or
    :class:`~orca_sc.DiscoveryConfig`) field, which is also the keyword of ``tl.annotate``; the
    command line reports it under its own option name (``--warmup-epochs``).
    """

    def __init__(self, option: str, value: Any, expected: str) -> None:
        self.option = option
        self.value = value
        self.expected = expected
        super().__init__(f"Invalid {option}={value!r}: expected {expected}.")
