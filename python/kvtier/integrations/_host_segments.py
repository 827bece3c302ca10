"""Moving pages between an engine's host buffers and a kvtier staging area.

An engine describes a page as a list of segments (pointer, size) inside its
host buffers: SGLang's ``get_page_buffer_meta`` lists K and V per layer, a
Mamba state's temporal and conv parts, an indexer's rows. kvtier stores a
page as those segments back to back. Copying them one by one costs a Python
call per segment (thousands per batch for a real model), so the copies here
cut every segment into rows of ``G`` bytes, ``G`` the greatest common
divisor of every offset and size involved, and move all rows of one buffer
with one vectorised ``index_select`` / ``index_copy_``. When the segments
share no divisor of at least ``MIN_ROW`` bytes (the row index would rival
the data in size), the copy falls back to one ``memmove`` per segment.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

# Rows narrower than this make the row index (8 bytes a row) too large
# next to the bytes it moves.
MIN_ROW = 64


class HostBuffers:
    """The memory of one host pool: its buffer tensors as flat byte views,
    sorted by address, so that a segment pointer resolves to (buffer,
    offset) and every copy stays inside a tensor the pool owns."""

    def __init__(self, tensors):
        spans = []
        for t in tensors:
            if t is None:
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("kvtier: a host pool buffer must be one contiguous CPU tensor")
            flat = t.reshape(-1).view(torch.uint8)
            spans.append((flat.data_ptr(), flat.numel(), flat))
        spans.sort(key=lambda s: (s[0], -s[1]))
        kept: list[tuple[int, int, torch.Tensor]] = []
        for start, size, flat in spans:
            if kept and start < kept[-1][0] + kept[-1][1]:
                # K and V views of one tensor: keep the enclosing one.
                if start + size <= kept[-1][0] + kept[-1][1]:
                    continue
                raise ValueError("kvtier: host pool buffers overlap without one containing the other")
            kept.append((start, size, flat))
        if not kept:
            raise ValueError("kvtier: the host pool exposes no buffer")
        self.starts = np.array([s for s, _, _ in kept], dtype=np.int64)
        self.sizes = np.array([n for _, n, _ in kept], dtype=np.int64)
        self.flats = [f for _, _, f in kept]

    def locate(self, ptrs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(buffer index, offset in that buffer) of every segment; raises
        ValueError for a segment not wholly inside one buffer (the engine's
        page description and its buffers disagree: never copy blindly)."""
        which = np.searchsorted(self.starts, ptrs, side="right") - 1
        if len(ptrs) and (which < 0).any():
            raise ValueError("kvtier: a page segment lies before every host pool buffer")
        offsets = ptrs - self.starts[which]
        if len(ptrs) and ((offsets + sizes) > self.sizes[which]).any():
            raise ValueError("kvtier: a page segment runs past the end of its host pool buffer")
        return which, offsets


@dataclass
class SegmentCopy:
    """Segments to move between host buffers and a staging byte tensor:
    segment ``i`` is ``size[i]`` bytes at ``offset[i]`` of buffer
    ``buffer[i]`` and at ``staged[i]`` of the staging area."""

    buffer: np.ndarray
    offset: np.ndarray
    staged: np.ndarray
    size: np.ndarray


def _rows(starts: np.ndarray, counts: np.ndarray) -> torch.Tensor:
    """The row indices start[i] .. start[i] + count[i], concatenated."""
    total = int(counts.sum())
    firsts = np.cumsum(counts) - counts
    index = np.repeat(starts - firsts, counts) + np.arange(total, dtype=np.int64)
    return torch.from_numpy(index)


def _row_width(copy: SegmentCopy) -> int:
    g = 0
    for part in (copy.offset, copy.staged, copy.size):
        if len(part):
            g = int(np.gcd(g, int(np.gcd.reduce(part))))
    return g


def copy_segments(host: HostBuffers, copy: SegmentCopy, staging: torch.Tensor, *, to_staging: bool) -> None:
    """Moves every segment of ``copy`` from the host buffers into
    ``staging`` (``to_staging``) or back."""
    if len(copy.size) == 0:
        return
    if int((copy.staged + copy.size).max()) > staging.numel():
        raise ValueError("kvtier: staged segments run past the staging area")
    g = _row_width(copy)
    if g < MIN_ROW:
        base = staging.data_ptr()
        for b, off, at, size in zip(copy.buffer, copy.offset, copy.staged, copy.size):
            host_ptr = host.flats[b].data_ptr() + int(off)
            stage_ptr = base + int(at)
            if to_staging:
                ctypes.memmove(stage_ptr, host_ptr, int(size))
            else:
                ctypes.memmove(host_ptr, stage_ptr, int(size))
        return
    stage_rows = staging[: staging.numel() - staging.numel() % g].view(-1, g)
    counts = copy.size // g
    for b in np.unique(copy.buffer):
        mask = copy.buffer == b
        flat = host.flats[b]
        host_rows = flat[: flat.numel() - flat.numel() % g].view(-1, g)
        host_index = _rows(copy.offset[mask] // g, counts[mask])
        stage_index = _rows(copy.staged[mask] // g, counts[mask])
        first = int(stage_index[0]) if len(stage_index) else 0
        contiguous = bool(
            len(stage_index) and int(stage_index[-1]) - first + 1 == len(stage_index)
            and bool((stage_index[1:] > stage_index[:-1]).all())
        )
        if to_staging:
            if contiguous:
                torch.index_select(host_rows, 0, host_index, out=stage_rows[first: first + len(stage_index)])
            else:
                stage_rows.index_copy_(0, stage_index, host_rows.index_select(0, host_index))
        else:
            source = stage_rows[first: first + len(stage_index)] if contiguous else stage_rows.index_select(
                0, stage_index)
            host_rows.index_copy_(0, host_index, source)
