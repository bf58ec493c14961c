"""Where the Triton chunk attention does not build on a GPU (e.g. its tiles need more shared memory
than the card has), app/engine/hf/layers.py `chunk_attention` logs why once and takes torch's path
from then on; any other failure is not swallowed."""

from __future__ import annotations

import logging

import pytest
import torch

from app.engine.hf import layers


class OutOfResources(Exception):
    """Stands for Triton's own: an exception from a `triton` module."""


OutOfResources.__module__ = "triton.runtime.errors"


@pytest.fixture
def chunk():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 8, 16, generator=generator)
    k, v = torch.randn(1, 2, 20, 16, generator=generator), torch.randn(1, 2, 20, 16, generator=generator)
    return q, k, v


@pytest.fixture(autouse=True)
def no_failures(monkeypatch):
    monkeypatch.setattr(layers, "KERNEL_FAILURES", [])


@pytest.mark.parametrize("window", [None, 6])
def test_a_kernel_that_does_not_build_falls_back_to_torch_once_and_for_all(monkeypatch, chunk, caplog, window):
    calls = []

    def unbuildable(*args, **kwargs):
        calls.append(1)
        raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 101376")

    monkeypatch.setattr(layers, "kernel_for", lambda q: None if layers.KERNEL_FAILURES else unbuildable)
    q, k, v = chunk
    want = layers.chunk_attention_with(None, q, k, v, 0.25, window)
    with caplog.at_level(logging.WARNING, logger="djev.engine"):
        first = layers.chunk_attention(q, k, v, 0.25, window)
        second = layers.chunk_attention(q, k, v, 0.25, window)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert calls == [1]  # tried once; the second chunk went straight to torch's path
    assert layers.KERNEL_FAILURES and "OutOfResources" in layers.KERNEL_FAILURES[0]
    assert sum("does not run on this GPU" in record.getMessage() for record in caplog.records) == 1


def test_any_other_failure_of_the_kernel_is_raised(monkeypatch, chunk):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(layers, "kernel_for", lambda q: broken)
    q, k, v = chunk
    with pytest.raises(RuntimeError, match="illegal memory access"):
        layers.chunk_attention(q, k, v, 0.25, None)
    assert layers.KERNEL_FAILURES == []


def test_cpu_tensors_never_take_the_kernel_even_where_triton_imports(monkeypatch, chunk):
    monkeypatch.setattr(layers, "triton_kernel", lambda: "the kernel")
    q = chunk[0]
    assert layers.kernel_for(q) is None and layers.kernel_for(q.to(torch.bfloat16)) is None
