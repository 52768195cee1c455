"""Host values onto the device without a blocking copy."""
from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device, dtype=None) -> torch.Tensor:
    """Host values (an array or a list, as `dtype`) on the device; on CUDA through pinned memory,
    without waiting for the copy (the caching host allocator keeps the pinned buffer alive until
    the copy has run). Never torch.tensor(list, device=cuda): that copy blocks until the whole
    stream has caught up."""
    t = torch.from_numpy(np.asarray(values, dtype=dtype))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
