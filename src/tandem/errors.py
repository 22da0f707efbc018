"""Typed errors. The CLI prints their message on one line and exits with code 2."""


class TandemError(Exception):
    """Base of every error tandem raises on purpose (bad input, impossible request)."""


class GGUFFormatError(TandemError):
    """The file is not a well-formed GGUF file (bad magic, truncated, out-of-bounds data)."""


class UnsupportedModelError(TandemError):
    """The file is valid GGUF but uses an architecture, quant type or feature tandem lacks."""


class MissingMetadataError(UnsupportedModelError):
    """A metadata key the architecture needs is absent."""


class PlacementError(TandemError):
    """A placement flag cannot be honoured (bad regex, unknown device, budget too small, ...)."""


class ChatTemplateError(TandemError):
    """The model has no chat template, or the template failed or was refused by the sandbox."""


class ConversionError(TandemError):
    """`tandem convert` cannot convert the given checkpoint."""


class InstallationError(TandemError):
    """A library tandem needs is missing or is not the build it needs."""


def os_reason(e: OSError) -> str:
    """An OSError for a one-line message, naming the path that failed: creating `out.gguf`'s folder fails on the
    folder, not on `out.gguf`."""
    if e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return e.strerror or str(e)
