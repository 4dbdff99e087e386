"""Data sets of the Hugging Face hub, through the optional `datasets` library (imported here, when a
hub data set is asked for): the training sources `hf:DATASET_ID[:split]` (data/sources.py) and the
benchmarks' fallback when the data directory has no file (eval/benchmarks.py). Offline or without
`datasets` loading can only fail; HubUnavailable says why, and each caller says how to go on with
a local file.
"""

from __future__ import annotations


class HubUnavailable(Exception):
    """A hub data set that could not be read: `datasets` is not installed, or the library failed
    (offline, an unknown data set or split); the message says which."""


def hub_rows(dataset_id: str, split: str, config: str | None = None):
    """The rows (dicts) of one split of a hub data set, as `datasets` returns them."""
    try:
        import datasets
    except ImportError:
        raise HubUnavailable("datasets is not installed") from None
    try:
        if config:
            return datasets.load_dataset(dataset_id, config, split=split)
        return datasets.load_dataset(dataset_id, split=split)
    except Exception as err:  # the library raises many types (connection, not found, offline mode)
        raise HubUnavailable(f"{type(err).__name__}: {err}") from err
