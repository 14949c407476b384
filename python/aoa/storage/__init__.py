"""Checkpoint storage: one module per format behind one interface (`aoa.storage.formats`)."""

from aoa.storage.formats import (
    FORMAT_NAMES,
    Destination,
    Fill,
    Format,
    OutputFile,
    Piece,
    Source,
    detect,
    format_named,
    open_source,
)

__all__ = ["FORMAT_NAMES", "Destination", "Fill", "Format", "OutputFile", "Piece", "Source",
           "detect", "format_named", "open_source"]
