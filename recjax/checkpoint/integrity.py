"""Digests: every array a checkpoint writes has its sha256 in the step's meta (`describe_arrays`, hashed on a worker
thread by `Checksums` while the save goes on), and meta has the sha256 of its own canonical JSON (`meta_digest`), so
one digest covers every byte a restore uses. Arrays spread over processes are hashed by blocks instead
(recjax/checkpoint/blocks.py)."""

import concurrent.futures
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from recjax.checkpoint import blocks
from recjax.checkpoint.streamed import RowBlocks

BLOCKS = "blocks"  # meta["arrays"] marker: an array saved by blocks (each process its own), checked by digests

DIGESTS = "digests"  # meta["arrays"] marker: the sha256s of those blocks (the `digests` item)

META_DIGEST = "sha256"  # meta's own key: the sha256 of everything else in it (`meta_digest`)


def sha256(array) -> str:
    """The sha256 of an array's C-ordered bytes; an array read by row blocks (`RowBlocks`) is hashed block by block
    (the same digest)."""
    if isinstance(array, RowBlocks):
        return array.sha256()
    return blocks.digest(array).hex()


def flat(tree: Mapping, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """{"a/b": leaf} of a nested dict (keys joined by `sep`)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flat(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflat(flat: Mapping[str, Any]) -> dict:
    """The inverse of `flat`."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, name = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def nbytes(tree: Mapping) -> int:
    return int(sum(a.nbytes if isinstance(a, jax.Array | RowBlocks) else np.asarray(a).nbytes
                   for a in flat(tree).values()))


def describe_arrays(item: str, tree: Mapping) -> dict[str, list]:
    """{item/path: [dtype, shape, sha256]} for every array of an item; an array spread over processes has
    "blocks" instead of a sha256: its blocks' sha256s are the `digests` item (`blocks.block_digests`)."""
    return {f"{item}/{p}": [str(a.dtype), list(a.shape), BLOCKS] if blocks.is_global(a) else
            [str(np.dtype(a.dtype)), list(a.shape), sha256(a)] if isinstance(a, RowBlocks) else
            [str(np.asarray(a).dtype), list(np.shape(a)), sha256(np.asarray(a))] for p, a in flat(tree).items()}


def meta_digest(meta: Mapping) -> str:
    """The sha256 of `meta` without its own digest, as canonical JSON (sorted keys, no spaces) of what JSON reads back
    (tuples become lists, keys strings), so the dict saved and the dict read hash alike. The arrays' sha256s are in
    meta, so this one digest covers every byte a restore uses."""
    content = json.loads(json.dumps({k: v for k, v in meta.items() if k != META_DIGEST}))
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def local_value(array) -> np.ndarray:
    """The host value of an array every process holds whole (a replicated multi-process array: its local copy)."""
    if blocks.is_global(array):
        return np.array(array.addressable_data(0))
    return np.array(array)


class Checksums:
    """meta["arrays"] ({item/path: [dtype, shape, sha256]}), hashed on a worker thread while the save goes on; the
    meta handler below waits for it in Orbax's background commit, so the train loop never does."""

    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recjax-sha256")

    def __init__(self, items: Mapping[str, Mapping], extra: Mapping[str, list] | None = None):
        self._future = self._pool.submit(lambda: {**{k: v for item, tree in items.items()
                                                     for k, v in describe_arrays(item, tree).items()},
                                                  **(extra or {})})

    def result(self) -> dict:
        return self._future.result()

    def stop(self) -> None:
        """The save failed: wait until the hashing is over (an array read by row blocks stops at its next block once
        it has a `failure`), whatever its outcome."""
        if not self._future.cancel():
            concurrent.futures.wait([self._future])
