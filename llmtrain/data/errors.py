"""Errors raised for data settings a user can fix.

Every message names the config field at fault (e.g. `data.format`) and says how to fix it,
so a bad setting fails before any model is loaded, with one readable line.
"""


class DataConfigError(ValueError):
    """A data setting (files, format, columns, lengths, tokenizer) that cannot work as given."""
