"""What an encoder did with a row: every encoder returns its `outcome`, and DataStats counts them."""

KEPT, TRUNCATED = "kept", "truncated"
CHUNKED, NEXT_CHUNK = "chunked", "next_chunk"  # a text split into rows: its first row, each further row
DROPPED_OVERLONG, DROPPED_NO_TARGET = "dropped_overlong", "dropped_no_target"
DROPPED_IDENTICAL, DROPPED_EMPTY = "dropped_identical", "dropped_empty"  # preference pairs only
OVERLONG_POLICIES = ("truncate", "drop", "chunk")
TRAINED = (KEPT, TRUNCATED, CHUNKED, NEXT_CHUNK)
