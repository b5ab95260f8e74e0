"""The pretraining peers, imported the way they install beside torch 2.13 (see scripts/test.sh):
from their own folder, ``<venv>/peers``, which importing this module appends to ``sys.path``.

* megatron-core 0.19.2: ``IndexedDataset``, ``IndexedDatasetBuilder``, ``GPTDataset`` (+ config, split,
  and its own ``NullTokenizer`` for a tokenizer-less ``GPTDatasetConfig``). Its package
  ``megatron/core/__init__.py`` imports the whole training stack (and triton, and patches
  ``torch.storage._load_from_bytes``), so it is never executed here: the ``megatron.core`` package
  object is created from its own import spec (``module_from_spec``, real ``__path__``/``__file__``,
  body not run) and the dataset submodules are then imported normally, from the installed files,
  unmodified. The only ordering needed is ``parallel_state`` before ``utils`` (their mutual import
  is resolved by the package ``__init__`` in the usual path).
* ai2-olmo-core 3.0.0: ``NumpyFSLDataset`` (fixed sequence length) and ``olmo_core.data.utils``
  (``write_array_to_disk``, ``iter_document_indices``).
* litdata 0.2.76: ``StreamingDataset``, ``TokensLoader``, ``optimize``.

Each ``load_*()`` raises :class:`PeerMissing` (an ``ImportError``) with the install line when the
peer is absent; each ``need_*()`` turns that into a pytest skip with the same message. The benchmark
(scripts/bench_pretrain.py) imports this file too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types
import warnings

# Where scripts/test.sh installs the peers, apart from the venv's packages (their declared dependencies
# conflict with the venv's): looked in after the venv's own packages, so that nothing here replaces one.
PEERS = os.path.join(sys.prefix, "peers")
if os.path.isdir(PEERS) and PEERS not in sys.path:
    sys.path.append(PEERS)
_TARGET = f"--no-deps --ignore-requires-python --target {PEERS}"
INSTALL = {
    "megatron": f"pip install {_TARGET} megatron-core==0.19.2",
    "olmo": (f"pip install {_TARGET} ai2-olmo-core==3.0.0 cached-path==1.8.10 && "
             "pip install dataclass-extensions==0.5.0 bettermap==1.3.1 google-cloud-storage==3.17.1"),
    "litdata": f"pip install {_TARGET} litdata==0.2.76",
}


class PeerMissing(ImportError):
    pass


def _missing(peer: str, err: BaseException) -> PeerMissing:
    return PeerMissing(f"pretraining peer {peer!r} not importable ({type(err).__name__}: {err}); "
                       f"install it as scripts/test.sh does: {INSTALL[peer]}")


def _megatron_core_package() -> bool:
    """Put an un-executed ``megatron.core`` package object (from its real spec) into sys.modules;
    False where ``megatron.core`` was already imported (then it is used as it is)."""
    if "megatron.core" in sys.modules:
        return False
    spec = importlib.util.find_spec("megatron.core")  # imports namespace package 'megatron' only
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'megatron.core'")
    pkg = importlib.util.module_from_spec(spec)  # __path__, __file__, __spec__ set; body not run
    sys.modules["megatron.core"] = pkg
    setattr(sys.modules["megatron"], "core", pkg)
    return True


@functools.cache
def load_megatron() -> types.SimpleNamespace:
    created = False
    try:
        import torch  # noqa: F401  (megatron's modules import it; first, so its own triton probe runs normally)

        created = _megatron_core_package()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed ..."
            importlib.import_module("megatron.core.parallel_state")
            idx = importlib.import_module("megatron.core.datasets.indexed_dataset")
            gpt = importlib.import_module("megatron.core.datasets.gpt_dataset")
            utils = importlib.import_module("megatron.core.datasets.utils")
            null = importlib.import_module("megatron.core.tokenizers.text.libraries.null_tokenizer")
            importlib.import_module("megatron.core.datasets.helpers_cpp")  # the compiled sample-index builder
    except Exception as e:  # noqa: BLE001  (any failure to import is "missing" for a test)
        if created:  # leave no half-made package behind
            for name in [m for m in sys.modules if m == "megatron.core" or m.startswith("megatron.core.")]:
                del sys.modules[name]
        raise _missing("megatron", e) from e
    return types.SimpleNamespace(IndexedDataset=idx.IndexedDataset, IndexedDatasetBuilder=idx.IndexedDatasetBuilder,
                                 DType=idx.DType, GPTDataset=gpt.GPTDataset, GPTDatasetConfig=gpt.GPTDatasetConfig,
                                 Split=utils.Split, NullTokenizer=null.NullTokenizer)


@functools.cache
def load_olmo() -> types.SimpleNamespace:
    try:
        from olmo_core.data import utils
        from olmo_core.data.numpy_dataset import NumpyFSLDataset
    except Exception as e:  # noqa: BLE001
        raise _missing("olmo", e) from e
    return types.SimpleNamespace(NumpyFSLDataset=NumpyFSLDataset, write_array_to_disk=utils.write_array_to_disk,
                                 iter_document_indices=utils.iter_document_indices,
                                 get_document_lengths=utils.get_document_lengths)


@functools.cache
def load_litdata() -> types.SimpleNamespace:
    try:
        from litdata import StreamingDataset, optimize
        from litdata.streaming.item_loader import TokensLoader
    except Exception as e:  # noqa: BLE001
        raise _missing("litdata", e) from e
    return types.SimpleNamespace(StreamingDataset=StreamingDataset, TokensLoader=TokensLoader, optimize=optimize)


def _need(load):
    import pytest

    try:
        return load()
    except PeerMissing as e:
        pytest.skip(str(e))


def need_megatron() -> types.SimpleNamespace:
    return _need(load_megatron)


def need_olmo() -> types.SimpleNamespace:
    return _need(load_olmo)


def need_litdata() -> types.SimpleNamespace:
    return _need(load_litdata)


def megatron_gpt_dataset(mc, prefix: str, seq_len: int, seed: int, cache_dir: str | None,
                         num_samples: int | None = None, vocab_size: int = 65_536):
    """megatron-core's ``GPTDataset`` over the .bin/.idx pair at ``prefix``: every document, split 'train',
    no tokenizer (megatron's own ``NullTokenizer``), no [L, L] attention mask (flash-attention style),
    index files cached under ``cache_dir`` (None: built in memory, not written).

    Returns (dataset, build_seconds)."""
    import time

    import numpy as np

    config = mc.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=([prefix], None), split="1,0,0",
        path_to_cache=cache_dir, tokenizer=mc.NullTokenizer(vocab_size), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
    indexed = mc.IndexedDataset(prefix, multimodal=False, mmap=True)
    t = time.perf_counter()
    ds = mc.GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32), num_samples, mc.Split.train, config)
    return ds, time.perf_counter() - t
