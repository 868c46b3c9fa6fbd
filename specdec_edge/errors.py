"""User-facing errors: each says what was wrong and what to do about it.

The CLI prints these as one line (no traceback) and exits with status 2.
"""


class SpecdecError(Exception):
    """An error caused by input the user can fix."""


class BundleError(SpecdecError):
    """A bundle on disk is missing, malformed, corrupted or incompatible."""


class ExportError(SpecdecError):
    """Export could not produce a valid bundle."""
