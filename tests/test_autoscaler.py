"""The autoscaler played with real servers: ``benchmarks.autoscale.play`` runs ``batchwire
serve`` processes behind one name (127.0.0.1, .2 at one port, the name answered by a
stand-in for DNS that names the servers up, as a headless Service names ready pods),
trainers that rise from one to five and fall back to one, and Kubernetes' HPA arithmetic on
the servers' ``/metrics`` every 2 s, which starts a server and later stops one (SIGTERM: it
drains mid-epoch). Every epoch of every trainer is exact through it; the rate rises with the
server added.
"""

from __future__ import annotations

import pathlib
import statistics

import numpy as np
import pytest

from benchmarks.autoscale import Policy, play

pytestmark = pytest.mark.slow  # about 40 s: servers started, loads held for several ticks


def test_servers_follow_the_trainers_and_every_epoch_stays_exact(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    policy = Policy(min_replicas=1, max_replicas=2)
    run = play(data_dir, tmp_path, policy=policy, period=2.0)
    # Every trainer's every epoch, whole or cut short by its stop: its plan's ids, in order,
    # each once, whichever servers carried them.
    for trainer in run.trainers:
        assert trainer.error is None, trainer.error
        assert trainer.exact(520) == []
    light = run.trainers[0]
    assert len(light.epochs) >= 3
    # Up on the metric's word: under the heavy load one server reported trainers waiting
    # more than the target, and a second server started, joined the name and took batches.
    heavy_on_one = [t for t in run.ticks if t.phase == "heavy" and t.servers == 1 and t.settled]
    assert heavy_on_one and all(t.recommended == 2 for t in heavy_on_one[-1:])
    assert heavy_on_one[-1].waiting_share > policy.waiting_target
    assert len(run.started) == 2 and len(run.scaled_up) == 1
    (_, _, first_batch) = run.scaled_up[0]
    assert np.isfinite(first_batch), "the server added took no batch"
    # The rate rose with it.
    one, two = run.rates("heavy", 1), run.rates("heavy", 2)
    assert one and two and statistics.median(two) > statistics.median(one)
    # Down on the metric's word, once the load fell: the light trainer hardly waited and the
    # pipelines idled (of two servers, one could go) for the whole scale-down window.
    (stopped_at, stopped, status) = run.stopped[0]
    assert len(run.stopped) == 1 and status == 0, "the server drained and exited 0"
    before = [t for t in run.ticks if t.phase == "light" and t.servers == 2 and t.settled]
    assert before and before[-1].recommended == 1
    assert before[-1].waiting_share < policy.waiting_target / 2
    assert before[-1].busy_share < policy.busy_target / 2
    # Mid-epoch: the stopped server's stream ended with UNAVAILABLE (its trainer resumed on
    # the other from its cursor), and the trainer went on taking batches after it.
    assert "status=UNAVAILABLE" in stopped.log.read_text()
    assert max(light.batch_times) > run.begun + stopped_at
    assert [t.servers for t in run.ticks][-1] == 1
