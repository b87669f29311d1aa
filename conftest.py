"""Settings for every test and doctest (tests/ and src/aotgrad)."""

import os

# The disk cache (docs/caching.md) is off for the suite and the processes it starts: a test
# traces, and counts traces, as if no earlier run left graphs behind, and nothing is written
# under ~/.cache. tests/test_persist.py turns it on, each test in a directory of its own.
os.environ["AOTGRAD_CACHE"] = "0"
