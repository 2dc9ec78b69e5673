"""A loader on the CPU on the server's host is lent its batches where they lie in the
server's shared memory, not copied out: its tensors are views of the ring, the same
batches as over the socket, and a buffer goes back to the server only once no view of
its batch is left. What the loop keeps stays as delivered, what it writes to a batch
changes no later one, and a forked child reads the batches its parent held. A real
server, real DALI on the CPU."""

from __future__ import annotations

import hashlib
import os

import torch
from test_shared_memory import RING, assert_same, eventually, loader, nothing_held

from batchwire.server import BatchwireServer


def ring_spans() -> list[tuple[int, int]]:
    """The address ranges of rings this process maps."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if RING in line:
                start, end = line.split()[0].split("-")
                spans.append((int(start, 16), int(end, 16)))
    return spans


def in_a_ring(tensor: torch.Tensor) -> bool:
    address = tensor.data_ptr()
    return any(start <= address < end for start, end in ring_spans())


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def test_batches_are_lent_where_they_lie_and_are_the_batches_of_the_socket(
    server: BatchwireServer,
) -> None:
    expected = list(loader(server.target, shared_memory=False))
    got, lent = [], 0
    with loader(server.target) as reading:
        for images, labels, ids in reading:
            lent += in_a_ring(images)
            got.append((images.clone(), labels, ids))
            del images
        copied, received = reading.transfer.copied, reading.transfer.received
    assert_same(got, expected)
    assert lent == len(got)  # each batch a view of the ring
    assert copied == 0 < received  # no byte of a batch copied on this side
    assert eventually(nothing_held)


def test_batches_the_loop_keeps_stay_as_delivered_while_the_ring_takes_later_ones(
    server: BatchwireServer,
) -> None:
    """The loop keeps every other batch and a view of each third: more than the ring
    lends at once, so that later batches come as copies, and the ring's buffers go back
    only as what is kept of them goes."""
    expected = list(loader(server.target, shared_memory=False))
    kept: dict[int, torch.Tensor] = {}
    rows: dict[int, torch.Tensor] = {}
    with loader(server.target) as reading:
        for n, (images, _, _) in enumerate(reading):
            if n % 2 == 0:
                kept[n] = images
            elif n % 3 == 0:
                rows[n] = images[1:3]
            del images
    assert len(expected) > 8
    held = [*kept.values(), *rows.values()]  # twelve: the ring lends eleven at a time
    assert any(in_a_ring(images) for images in held)
    assert not all(in_a_ring(images) for images in held)  # the rest were copied
    del held
    assert [n for n, images in kept.items() if not torch.equal(images, expected[n][0])] == []
    assert [n for n, row in rows.items() if not torch.equal(row, expected[n][0][1:3])] == []
    kept.clear()
    assert not nothing_held()  # the views still hold their ring
    rows.clear()
    assert eventually(nothing_held)


def test_what_the_loop_writes_to_a_batch_changes_no_later_batch(
    server: BatchwireServer,
) -> None:
    """Each batch, once checked, is overwritten in place (as a loop that normalizes in
    place would): the pages it writes become its own, are dropped when it lets go, and
    the buffer shows the server's next batch, not what the loop wrote."""
    expected = list(loader(server.target, shared_memory=False))
    written = 0
    with loader(server.target) as reading:
        for n, (images, _, _) in enumerate(reading):
            assert torch.equal(images, expected[n][0]), n
            written += in_a_ring(images)
            images.fill_(255 - n)  # every page of the batch written
            del images
    assert written == len(expected)
    assert eventually(nothing_held)


def test_a_forked_child_reads_the_batch_its_parent_held_after_the_ring_took_others(
    server: BatchwireServer,
) -> None:
    """The parent holds a lent batch at the fork, then lets go of it and reads the rest
    of the epoch, its buffer taking later batches; the child still reads the batch as it
    was delivered (a fork copies what its parent held, as it does any memory)."""
    with loader(server.target) as reading:
        batches = iter(reading)
        held, _, _ = next(batches)
        assert in_a_ring(held)
        want = digest(held)
        go_read, go_write = os.pipe()
        done_read, done_write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: reads its copy once the parent's ring moved on
            code = 1
            try:
                os.close(go_write)
                os.read(go_read, 1)
                code = 0 if digest(held) == want else 3
            finally:
                os.write(done_write, bytes([code]))
                os._exit(code)
        os.close(go_read)
        os.close(done_write)
        del held
        later = [digest(images) for images, _, _ in batches]
        os.write(go_write, b"1")
        answer = os.read(done_read, 1)
        _, status = os.waitpid(child, 0)
    assert len(later) > 8  # every buffer of the ring took another batch meanwhile
    assert answer == b"\x00" and os.waitstatus_to_exitcode(status) == 0
    assert eventually(nothing_held)
