"""The CPU adapter for megatron-core: its RNG tracker and device queries work on CPU."""

import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

from rlt_scale.megatron_cpu import route_megatron_to_cpu


def test_rng_tracker_forks_a_separate_stream_and_restores_the_default(ctx):
    assert route_megatron_to_cpu()  # no CUDA here: the routing is active
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(7)
    expected_default = torch.rand(3)
    torch.manual_seed(7)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)  # the default stream is untouched
    with get_cuda_rng_tracker().fork():
        forked_again = torch.rand(3)
    assert not torch.equal(forked, forked_again)  # the tracker's stream advanced
    assert not torch.equal(forked, expected_default)
