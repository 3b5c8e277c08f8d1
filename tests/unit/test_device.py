"""client/device.py and the sinks that use it, without shards: what holds on a host without CUDA (the CPU
fallback), and buffer reuse, which strided and cast CPU targets share with CUDA ones."""

import pytest
import torch

from torchps import codec
from torchps.client.device import DeviceStaging
from torchps.client.stats import WorkerStats
from torchps.client.transfer import IntoTargets

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback: tests/grpc/test_cuda.py on GPUs")


def land(sink: IntoTargets, name: str, value: torch.Tensor) -> None:
    """What read_stream does with one variable's chunks: the sink's buffer gets the bytes."""
    buffer = sink(name, codec.meta_of(value))
    buffer[:] = codec.byte_array(value.contiguous())


def test_without_cuda_nothing_is_pinned_and_cpu_tensors_pass_through_untouched():
    staging = DeviceStaging()
    assert staging.pinned is False
    grads = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    staged = staging.stage_out(grads)
    assert all(staged.tensors[name] is grads[name] for name in grads) and staged.nbytes == 0
    staged.release()
    assert staging.mark(grads.values()) == {}


def test_a_buffer_is_reused_once_released_and_two_holders_get_two():
    staging = DeviceStaging()
    first = staging.acquire("pull/w", (4, 2), torch.float32, pin=True)
    second = staging.acquire("pull/w", (4, 2), torch.float32, pin=True)
    assert first.data_ptr() != second.data_ptr()
    staging.release("pull/w", first)
    assert staging.acquire("pull/w", (4, 2), torch.float32, pin=True).data_ptr() == first.data_ptr()
    assert staging.acquire("pull/w", (8,), torch.float32, pin=True).data_ptr() != first.data_ptr()


def test_strided_and_cast_targets_land_through_buffers_reused_from_pull_to_pull():
    staging, stats = DeviceStaging(), WorkerStats()
    whole = torch.zeros(3, 4)
    targets = {"strided": whole.t(), "cast": torch.zeros(5), "direct": torch.zeros(2)}
    pointers = []
    for step in range(3):
        sink = IntoTargets(targets, stats, staging)
        values = {"strided": torch.arange(12.0).reshape(4, 3) + step,
                  "cast": (torch.arange(5.0) + step).to(torch.bfloat16), "direct": torch.full((2,), float(step))}
        for name, value in values.items():
            land(sink, name, value)
        pointers.append({name: buffer.data_ptr() for name, buffer in sink._staging.items()})
        sink.finish()
        for name, value in values.items():
            torch.testing.assert_close(targets[name], value.to(torch.float32), atol=0, rtol=0)
    assert set(pointers[0]) == {"strided", "cast"}, "a contiguous CPU target takes the bytes directly"
    assert pointers[0] == pointers[1] == pointers[2], "no new buffer per pull"


def test_complete_lands_one_target_at_once_and_finish_leaves_it_alone():
    staging = DeviceStaging()
    target = torch.zeros(4, 2).t()
    sink = IntoTargets({"w": target}, staging=staging)
    land(sink, "w", torch.ones(2, 4))
    sink.complete("w")
    assert torch.equal(target, torch.ones(2, 4))
    target.zero_()
    sink.finish()
    assert torch.equal(target, torch.zeros(2, 4)), "finish() copies nothing twice"
