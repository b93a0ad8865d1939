"""Reading a DCP checkpoint without running arbitrary pickle code.

torch.distributed.checkpoint writes its ``.metadata`` with pickle, and its FileSystemReader reads
it back with a plain ``pickle.load``: a tampered checkpoint folder could run any code on every
rank. The tensors are already read with ``torch.load(weights_only=True)``. ``SafeFileSystemReader``
is the stock reader except that the metadata's pickle may only name the classes DCP itself
writes there (its metadata dataclasses, torch dtypes and Size, the layout helper, paths);
anything else is refused with a one-line error naming the file and the global.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# Only the classes that module defines: its namespace also holds what it imports (typing's Any,
# enum's Enum, collections.abc's Sequence), which DCP never pickles and a crafted pickle could name.
_DCP_CLASSES = {
    name
    for name, obj in vars(dcp_metadata).items()
    if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
}
_ALLOWED: dict[str, set[str]] = {
    dcp_metadata.__name__: _DCP_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"} | {n for n, obj in vars(torch).items() if isinstance(obj, torch.dtype)},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{self.source}: refusing to load {module}.{name} from checkpoint metadata "
            f"(not a DCP metadata type)"
        )


def load_metadata(file: io.BufferedIOBase, source: str = "checkpoint metadata") -> Any:
    """Unpickle DCP metadata through the allow-list (UnpicklingError names anything else)."""
    return _AllowListUnpickler(file, source).load()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``read_metadata`` goes through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = Path(self.path) / name
        with open(path, "rb") as f:
            metadata = load_metadata(f, str(path))
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path}: not DCP metadata ({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
