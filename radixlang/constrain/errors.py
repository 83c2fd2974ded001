"""The error every constraint module raises for a constraint it cannot build or follow."""

from __future__ import annotations


class ConstraintError(ValueError):
    """A constraint is invalid (bad or unsupported regex, unknown dtype) or was broken."""
