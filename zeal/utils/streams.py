"""Streams and events behind one small interface, so the code that orders copies and
collectives has a single path: on CUDA a :class:`CudaStream` (a ``torch.cuda.Stream``
and its events), elsewhere a :class:`NullStream` whose every call is the identity
(work runs in program order on the host, so there is nothing to wait for).

The ordering vocabulary is CUDA's: work issued inside ``with stream:`` runs on it;
``stream.wait_stream(other)`` makes later work on ``stream`` wait for what was issued on
``other`` so far; ``ev = stream.record_event()`` marks the point reached, and
``other.wait_event(ev)`` (device side) or ``ev.synchronize()`` (host side) waits for it.
Tests substitute a fake that records these calls.
"""

from __future__ import annotations

import torch


def is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device on a machine where CUDA is usable."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class NullEvent:
    """An event on the host's program order: always reached."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NullStream:
    """The identity stream (CPU): entering it, waiting and recording do nothing."""

    def __enter__(self) -> NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self) -> NullEvent:
        return NullEvent()

    def keep(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s memory until work issued so far on this stream is done."""


class CudaStream:
    """A ``torch.cuda.Stream`` with the interface above."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._ctx = None

    def __enter__(self) -> CudaStream:
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)

    def wait_stream(self, other: CudaStream) -> None:
        self.stream.wait_stream(other.stream)

    def wait_event(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def record_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def keep(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            tensor.record_stream(self.stream)


def side_stream(device: torch.device | str) -> CudaStream | NullStream:
    """A new stream beside the compute stream of ``device`` (the identity off CUDA)."""
    if is_cuda(device):
        return CudaStream(torch.cuda.Stream(device=torch.device(device)))
    return NullStream()


def current_stream(device: torch.device | str) -> CudaStream | NullStream:
    """The stream work on ``device`` is issued to now (the identity off CUDA)."""
    if is_cuda(device):
        return CudaStream(torch.cuda.current_stream(torch.device(device)))
    return NullStream()
