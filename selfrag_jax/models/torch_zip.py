"""PyTorch `torch.save` checkpoints (`pytorch_model.bin`) read with numpy only.

Only the globals that rebuild plain tensors are allowed, so unlike `torch.load` reading a
file cannot run code, and torch need not be installed.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


def load_torch_zip(path: Path) -> dict[str, np.ndarray]:
    """Reads a `torch.save` zip checkpoint of plain tensors with numpy only.

    Only tensor-rebuilding globals are allowed, so unlike `torch.load` it cannot run code.
    """
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not a zip-format torch checkpoint (re-save it with torch>=1.6 or as safetensors)") from None
    with zf:
        pkl_name = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl_name is None:
            raise ValueError(f"{path}: no data.pkl inside")
        prefix = pkl_name[: -len("data.pkl")]

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str):
                if module == "torch._utils" and name == "_rebuild_tensor_v2":
                    return _rebuild_tensor
                if module == "torch._utils" and name == "_rebuild_parameter":
                    return lambda data, requires_grad, hooks: data
                if module == "torch" and name == "BFloat16Storage":
                    import ml_dtypes

                    return ml_dtypes.bfloat16
                if module == "torch" and name in _STORAGE_DTYPES:
                    return _STORAGE_DTYPES[name]
                if module == "collections" and name == "OrderedDict":
                    return collections.OrderedDict
                raise pickle.UnpicklingError(f"{path}: unsupported object {module}.{name} in checkpoint")

            def persistent_load(self, pid):
                _, dtype, key, _location, _numel = pid
                return np.frombuffer(zf.read(f"{prefix}data/{key}"), dtype=dtype)

        with zf.open(pkl_name) as f:
            state = Unpickler(f).load()
    return {k: v for k, v in state.items() if isinstance(v, np.ndarray)}


def _rebuild_tensor(storage, offset, size, stride, *_):
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size), strides=[s * item for s in stride])
    return np.array(view)
