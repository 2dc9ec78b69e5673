"""One trainer process of ``--host-trainers``: ``python -m benchmarks._trainer ADDRESS
DATASET PIPELINE BATCH_SIZE``.

It streams epoch after epoch through a ``RemoteLoader`` (as ``batchwire bench --address``
does: full batches, not normalized), prints ``streaming`` once its first batch arrived,
and stops when its standard input closes (or says anything), then prints ``N images in
S s`` from its first batch on. So the harness can open its window once every trainer
streams and close it before any stops, whatever each took to start.
"""

from __future__ import annotations

import sys
import threading
import time


def main(argv: list[str]) -> int:
    from batchwire.client import RemoteLoader

    address, dataset, pipeline, batch_size = argv
    stop = threading.Event()

    def wait_for_stop() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_for_stop, name="trainer-stop", daemon=True).start()
    images = 0
    started: float | None = None
    with RemoteLoader(
        address,
        dataset=dataset,
        pipeline=pipeline,
        batch_size=int(batch_size),
        drop_last=True,
        normalize=False,
    ) as loader:
        while not stop.is_set():  # a pass run to its end: the next is the next epoch
            for batch, _ in loader:
                if started is None:
                    started = time.perf_counter()
                    print("streaming", flush=True)
                else:
                    images += len(batch)
                if stop.is_set():
                    break
    seconds = time.perf_counter() - (started or time.perf_counter())
    print(f"{images} images in {seconds:.3f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
