"""runtime/capture_stream.py: each family of CUDA graphs gets a capture stream that is neither
torch's default capture stream nor another family's (a shared one shares the cuBLAS workspace,
which graphs replayed at once on two streams would write together: bench/graph_race.py)."""
import pytest
import torch

from freetoken.runtime.capture_stream import own_capture_stream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_each_family_gets_a_stream_of_its_own():
    dev = torch.device("cuda")
    decode, prefill = own_capture_stream(dev, "decode"), own_capture_stream(dev, "prefill")
    for _ in range(40):  # more engines than the pool has streams: each family keeps its one
        assert own_capture_stream(dev, "decode") is decode
    handles = {decode.cuda_stream, prefill.cuda_stream}
    assert len(handles) == 2
    assert torch.cuda.graph.default_capture_stream.cuda_stream not in handles
    assert torch.cuda.default_stream(dev).cuda_stream not in handles
