"""crc32c of any contiguous buffer, computed with the GIL released.

google-crc32c (zarr's checksum library, and batchctl's) releases the GIL only for `bytes` of
1 MiB or more (its `_crc32c.c` tests `PyBytes_Check`); a NumPy batch, a memory mapping or a
bytearray is checked holding it. At ~8 GB/s here that is ~1.2 ms per 10 MB batch during which
no other thread of the process runs: the reader's read-ahead threads and the training loop, or
the collator's writer threads and its main thread, took turns instead of sharing the cores.

So the library inside google-crc32c's wheel (`google_crc32c.libs/libcrc32c-*.so`, the same code)
is called through ctypes, which releases the GIL for the call. This leans on the wheel's layout;
where the library is not found (another build of google-crc32c), `google_crc32c.value` is used,
right but holding the GIL. tests/test_transport.py checks both agree and which one is in use.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np


def _load() -> Any:
    package = Path(google_crc32c.__file__).resolve().parent
    for folder in (package.parent / "google_crc32c.libs", package):
        for library in sorted(folder.glob("libcrc32c*.so*")):
            try:
                lib = ctypes.CDLL(str(library))
                extend = lib.crc32c_extend
            except (OSError, AttributeError):
                continue
            extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            extend.restype = ctypes.c_uint32
            return extend
    return None


_extend = _load()
RELEASES_GIL = _extend is not None


def crc32c(data: Any, crc: int = 0) -> int:
    """The crc32c of `data` (bytes, a bytearray, a memoryview or a C-contiguous array), continuing
    from `crc` (the checksum of what came before it)."""
    view = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if not view.flags.c_contiguous:
        raise ValueError("crc32c needs a contiguous buffer")
    if not view.nbytes:
        return crc
    if _extend is None:
        return int(google_crc32c.extend(crc, view.tobytes()) if crc else google_crc32c.value(view))
    return int(_extend(crc, view.ctypes.data, view.nbytes))
