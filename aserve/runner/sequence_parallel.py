"""A step's rows under sequence parallelism: which rows a rank holds, and the hidden rows the
logits need, gathered from the ranks holding them.

```
step rows (T = 7, sp = 2, chunk = 4)    0 1 2 3 | 4 5 6 ·       (· padding: id 0, position 0)
rank 0 holds rows 0-3, rank 1 rows 4-6 and one padding row
logits of rows 3 and 6  →  rank 0 sends row 3, rank 1 row 6 (the local row 2)  →  [h3, h6]
```

Every rank holds the whole step's inputs (`PreparedInputs`) and attention metadata; it embeds,
norms and runs the MLPs of its rows only, and attention trades rows for heads
(`aserve/layers/ulysses.py`). One rank: these are the rows themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from aserve.distributed.all_to_all import all_gather_rows
from aserve.distributed.state import get_sp_group, get_sp_rank, get_sp_size


def chunk_size(num_rows: int, sp_size: int) -> int:
    """Rows each SP rank holds: ceil(num_rows / sp_size)."""
    return -(-num_rows // sp_size)


def local_rows(array: np.ndarray) -> np.ndarray:
    """This SP rank's rows of a step array [T]: rows [r * chunk, (r + 1) * chunk), the last
    slice padded with zeros."""
    size = get_sp_size()
    if size == 1:
        return array
    chunk = chunk_size(len(array), size)
    mine = array[get_sp_rank() * chunk:(get_sp_rank() + 1) * chunk]
    return np.pad(mine, (0, chunk - len(mine)))


def gather_rows(hidden: torch.Tensor, indices: np.ndarray, num_rows: int) -> torch.Tensor:
    """The step rows `indices` (of `num_rows`) of the hidden states every SP rank holds a slice
    of (`hidden`: this rank's [chunk, H]) -> [len(indices), H], in `indices`' order, on every
    SP rank."""
    size = get_sp_size()
    if size == 1 and len(indices) == num_rows and np.array_equal(indices, np.arange(num_rows)):
        return hidden  # every row, in order (a decode-only step): no copy
    if size == 1 or len(indices) == 0:  # (every SP rank has the same indices)
        return hidden[torch.from_numpy(indices).to(hidden.device)] if size == 1 else hidden[:0]
    chunk = chunk_size(num_rows, size)
    owner = indices // chunk  # [N]
    order = np.argsort(owner, kind="stable")  # indices grouped by rank, in rank order
    counts = np.bincount(owner, minlength=size).tolist()
    mine = indices[owner == get_sp_rank()] - get_sp_rank() * chunk
    rows = all_gather_rows(hidden[torch.from_numpy(mine).to(hidden.device)], counts,
                           get_sp_group())  # [N, H] in `order`
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return rows[torch.from_numpy(inverse).to(hidden.device)]
