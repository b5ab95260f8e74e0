"""``grain.constants``: the metadata feature names, with Grain's values.

Example:
    >>> from portable_loader.grain import constants
    >>> constants.INDEX, constants.RECORD_KEY in constants.META_FEATURES
    ('_index', True)
"""

INDEX = "_index"
RECORD_KEY = "_record_key"
DATASET_INDEX = "_dataset_index"
EPOCH = "_epoch"
SEED = "_seed"
RECORD = "_record"
META_FEATURES = frozenset([INDEX, RECORD_KEY, DATASET_INDEX, EPOCH, SEED, RECORD])
