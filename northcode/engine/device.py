"""What both backends do on the device the same way: host copies without a sync, the block tables' device copy,
carried tokens, and a step's tokens on their way back to the host.

Nothing here reads a device tensor from the host except `PendingTokens.host_values`, the one wait of a
launched step: inputs go up through pinned memory (non-blocking; the caching host allocator keeps a block
until its copy has run), a step's tokens come back through pinned memory behind a CUDA event. On the CPU the
same calls run at once. This file knows nothing of models, sampling or scheduling.
"""

from __future__ import annotations

import torch


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """dst <- host without waiting for the device's queue: on a GPU through a pinned copy of host (the
    caching host allocator keeps that block until the copy has run), so host may change right after."""
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    dst.copy_(pinned, non_blocking=True)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, enqueued without a sync (the CPU: host itself)."""
    if device.type != "cuda":
        return host.to(device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    copy_from_host(out, host)
    return out


def carried_tokens(token_ids: list[int], carry: list[int], previous: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor:
    """long [B] on the device: row b feeds previous[carry[b]] (a gather on the device) when carry[b] >= 0,
    else token_ids[b]. previous: the tokens the last launch sampled, device [B_prev]."""
    tokens = to_device(torch.tensor(token_ids, dtype=torch.long), device)
    if all(c < 0 for c in carry):
        return tokens
    index = to_device(torch.tensor(carry, dtype=torch.long), device)
    return torch.where(index >= 0, previous[index.clamp(min=0)], tokens)


class DeviceBlockTables:
    """The device copy of the engine's block tables, uploaded only when their version moved.

    `tables`: int32 [num_layers, max_batch + 1, max_pages_per_seq], -1 unmapped (what the megakernel and the
    prefill read); row max_batch stays -1 for padded decode rows. `page_of`: the same as long with the scratch
    page for -1 (what the torch decode step indexes the pool with, so its graph needs no kernel to translate).
    """

    def __init__(self, num_layers: int, max_batch: int, max_pages_per_seq: int, scratch_page: int,
                 device: torch.device) -> None:
        shape = (num_layers, max_batch + 1, max_pages_per_seq)
        self.max_batch, self.max_pages_per_seq, self.scratch_page = max_batch, max_pages_per_seq, scratch_page
        self.tables = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.page_of = torch.full(shape, scratch_page, dtype=torch.long, device=device)
        self.version = -1

    def upload(self, host_tables: torch.Tensor, version: int, columns: int | None = None) -> None:
        """Copy the host tables [L, max_batch, P] when they changed; only the first `columns` were ever set."""
        if version == self.version:
            return
        columns = self.max_pages_per_seq if columns is None else columns
        host = host_tables[:, :, :columns]
        copy_from_host(self.tables[:, :self.max_batch, :columns], host)
        page_of = torch.where(host < 0, self.scratch_page, host.long())  # on the host: no device kernel
        copy_from_host(self.page_of[:, :self.max_batch, :columns], page_of)
        self.version = version


class PendingTokens:
    """A launched step's tokens (and any words after them) on their way to the host: what each backend's
    PendingDecode (backend.py) waits on."""

    def __init__(self, values: torch.Tensor) -> None:
        """values: a device tensor [N] written by kernels enqueued and maybe not yet run."""
        self._done = None
        self._host = values
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()  # on the current stream, after the step and the copy

    def host_values(self) -> list[int]:
        """Wait for the copy (cudaEventSynchronize releases the GIL); the copied values."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
