"""A loader on the CPU lends the memory of batches the loop let go of to later batches,
and never the memory of a batch (or of any view of it) the loop still holds: what a
user keeps stays as it was delivered. A real server, real DALI on the CPU."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from batchwire.client import RemoteLoader
from batchwire.client._delivery import BatchMemory
from batchwire.server import BatchwireServer


def loader(server: BatchwireServer) -> RemoteLoader:
    made = RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=32,
        params={"size": 32},
        normalize=False,
        return_ids=True,
        seed=3,
    )
    made.set_epoch(1)
    return made


def test_batches_the_loop_keeps_stay_as_delivered_while_the_rest_are_reused(
    server: BatchwireServer,
) -> None:
    with loader(server) as batches:
        every = [images.clone() for images, _, _ in batches]
    kept: list[tuple[int, torch.Tensor]] = []
    views: list[torch.Tensor] = []
    addresses: list[int] = []
    with loader(server) as batches:
        for n, (images, _, _) in enumerate(batches):  # the same order: one seed and epoch
            addresses.append(images.data_ptr())
            if n % 3 == 0:
                kept.append((n, images))  # the batch itself
            elif n % 3 == 1:
                views.append(images[1:3])  # a view of it only
            del images
    assert len(every) == 520 // 32 + 1
    # Memory of batches let go of was lent again to later ones.
    assert len(set(addresses)) < len(addresses)
    for n, images in kept:
        assert torch.equal(images, every[n])
    for k, view in enumerate(views):
        assert torch.equal(view, every[3 * k + 1][1:3])


def test_memory_comes_back_when_the_last_view_goes() -> None:
    memory = BatchMemory(keep=2)
    first, array = memory((4, 8), np.dtype(np.float32))
    assert array.flags.writeable and array.flags.c_contiguous
    address = first.data_ptr()
    row = first[2]
    del first, array
    second, _ = memory((4, 8), np.dtype(np.float32))
    assert second.data_ptr() != address  # a row of the first is still held
    del row
    third, _ = memory((4, 8), np.dtype(np.float32))
    assert third.data_ptr() == address  # its last view went: lent again
    assert second.data_ptr() != third.data_ptr()


def test_a_forked_child_lends_memory_though_a_thread_held_the_lock_at_the_fork() -> None:
    memory = BatchMemory(keep=2)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with memory._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: no thread holds its lock any more
        try:
            tensor, _ = memory((16,), np.dtype(np.uint8))
            tensor.fill_(1)
            os._exit(0 if int(tensor.sum()) == 16 else 1)
        finally:
            os._exit(2)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
