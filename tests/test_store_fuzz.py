"""The crafted-file fuzzer's bounded run (tests/store_fuzz.py): mutated graph files and cache
entries are a correct load, a StoreError or a miss; never code run, a file written or a raw
exception. Deterministic (``derandomize=True``); ``python tests/store_fuzz.py --examples N``
runs a longer one."""

from __future__ import annotations

import store_fuzz


def test_crafted_files_are_refused_or_run_as_checked():
    store_fuzz.fuzz(examples=500)


def test_an_unchanged_file_of_each_seed_loads_and_matches():
    for seed in store_fuzz.seeds():
        assert store_fuzz.check(seed, "none", seed.data) == "ran"
