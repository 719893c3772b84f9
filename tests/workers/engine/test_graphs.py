"""KeyedGraphs (workers/engine/graphs.py): the capture and replay the runner, the settle and the
context-parallel ranks share. On CUDA only (a capture needs a device)."""

import pytest
import torch
from lockserve.workers.engine.graphs import GraphKey, KeyedGraphs

pytestmark = pytest.mark.gpu


def test_a_replay_reruns_the_capture_over_its_inputs_and_counts():
    x = torch.arange(4.0, device="cuda")  # the fixed input the capture reads
    graphs = KeyedGraphs(torch.cuda.graph_pool_handle())
    key = GraphKey(rows=1, width=64, k=8, scored=True)
    assert graphs.get(key) is None
    warm = x * 2  # the eager step before a capture (the warm-up)
    captured = graphs.capture(key, lambda: x * 2)
    assert graphs.get(key) is captured and len(graphs) == 1 and graphs.captures == 1
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    out = graphs.replay(captured)
    assert out is captured.output and out.tolist() == [10.0, 12.0, 14.0, 16.0]
    assert warm.tolist() == [0.0, 2.0, 4.0, 6.0]
    graphs.replay_events = []
    graphs.replay(captured)
    assert graphs.replays == 2 and len(graphs.replay_events) == 1
    start, end, called, returned = graphs.replay_events[0]
    torch.cuda.synchronize()
    assert start.elapsed_time(end) >= 0 and returned >= called
    with pytest.raises(AssertionError):
        graphs.capture(key, lambda: x * 3)  # a key is captured once


def test_drop_all_lets_keys_be_captured_again_in_a_fresh_pool():
    x = torch.ones(3, device="cuda")
    graphs = KeyedGraphs(torch.cuda.graph_pool_handle())
    graphs.capture(1, lambda: x + 1)
    pool = graphs.pool
    graphs.drop_all()
    assert len(graphs) == 0 and graphs.pool != pool
    out = graphs.replay(graphs.capture(1, lambda: x + 2))
    assert out.tolist() == [3.0, 3.0, 3.0]
