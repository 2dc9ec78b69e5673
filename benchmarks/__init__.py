"""batchwire's research benchmarks, run from a checkout (they are not installed).

    python -m benchmarks --messages                       # gRPC message sizes, parts vs whole
    python -m benchmarks --scaling                        # one server vs two pinned to their own core
    python -m benchmarks --duration 600                   # a long run: memory at start and end
    python -m benchmarks --stages                         # CPU per image of each stage, DALI vs PIL
    python -m benchmarks --streams 1,64,256 [--size 64]   # one server under K concurrent streams
    python -m benchmarks --mix                            # one server shared by several pipelines
    python -m benchmarks --fleet                          # two servers, one slowed: one loader over both
    python -m benchmarks --chaos --duration 300           # servers killed and restarted: exactly once?
    python -m benchmarks --cold --data-dir D --dataset N  # a dataset read from a cold page cache vs warm
    python -m benchmarks --profile --pipeline nodecode    # where a server's time and lock go (py-spy)
    python -m benchmarks --host-trainers 1,8              # a server and K trainers on one (GPU) host vs DALI
    python -m benchmarks --host-trainers 1,2,4,8,16 --pipeline wait \\
        --host-servers workers4 --batch-size 64           # the same, a GPU's work as a wait
    python -m benchmarks --autoscale                      # a fleet that grows and shrinks with its trainers

What a user measures is in the installed command: ``batchwire bench --address`` (a running
server, as a trainer sees it) and ``batchwire bench --compare`` (runs (a)..(e) side by side).
These modes build on its helpers (``batchwire.bench``: local servers, the runs,
the generated dataset cached in ``~/.cache/batchwire/bench``).
"""

from __future__ import annotations

from benchmarks._cli import MODES, build_parser, main

__all__ = ["MODES", "build_parser", "main"]
