"""A serving replica's defaults, in one place for ps-serve's flags and the code they configure. Imports
nothing."""

POLL_SECONDS = 0.2     # between reads of the shards' row changes
DENSE_SECONDS = 600.0  # between reads of the dense variables
KEEP_VERSIONS = 8      # versions kept for a rollback
