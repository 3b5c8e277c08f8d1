"""Large and unusual tensors survive the chunked wire exactly."""

import gc

import torch

from torchps import codec
from torchps.client import Optimizer, PSClient

BIG_ELEMENTS = 134_217_728  # 512 MiB of float32: 512 chunks of the default 1 MiB


def _pattern(n):
    """A cheap deterministic float32 pattern, non-decreasing, so any misplaced 1 MiB chunk differs."""
    return torch.arange(n, dtype=torch.float32)


def _info(ps, name):
    (info,) = [v for v in ps.list_variables() if v.spec.name == name]
    return info


def test_512mib_variable_round_trips_and_trains(shared_cluster):
    """create -> pull is exact for a 512 MiB variable, and a 512 MiB gradient push applies everywhere."""
    with PSClient(shared_cluster.cluster, partitioner=None) as ps:  # whole: test_partitioning.py cuts
        expected = _pattern(BIG_ELEMENTS)
        assert ps.create_variables({"big": expected}, Optimizer("sgd", lr=1.0)) == {"big": True}
        assert _info(ps, "big").nbytes == BIG_ELEMENTS * 4
        pulled = ps.pull(["big"])["big"]
        assert pulled.shape == (BIG_ELEMENTS,) and pulled.dtype == torch.float32
        assert torch.equal(pulled, expected)

        grad = torch.full((BIG_ELEMENTS,), 64.0)  # x - 64 is exact in float32 for every element here
        step = ps.push({"big": grad})
        del grad
        gc.collect()
        expected -= 64
        pulled.zero_()
        assert ps.pull_into({"big": pulled}) == step
        assert torch.equal(pulled, expected)
        del pulled, expected
        gc.collect()
        assert _info(ps, "big").version == 1


def _bits(tensor):
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def test_dtypes_round_trip_bit_exactly(shared_cluster):
    """'none' variables of every wire dtype come back bit for bit, special float values included,
    through chunks that split elements (chunk_bytes one byte over the 64 KiB minimum)."""
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 6e-8, -65504.0, 3.0e38]
    values = {
        "dt/bf16": torch.cat([torch.tensor(specials), torch.linspace(-5, 5, 60000)]).to(torch.bfloat16).reshape(-1, 3),
        "dt/f16": torch.cat([torch.tensor(specials), torch.linspace(-5, 5, 60000)]).to(torch.float16).reshape(3, -1),
        "dt/f32": torch.cat([torch.tensor(specials), torch.linspace(-5, 5, 60000)]),
        "dt/f64": torch.cat([torch.tensor(specials, dtype=torch.float64), torch.rand(20000, dtype=torch.float64)]),
        "dt/i64": torch.tensor([-(2 ** 63), 2 ** 63 - 1, 0, -1, 2 ** 53 + 1] * 4000, dtype=torch.int64),
        "dt/i32": torch.tensor([-(2 ** 31), 2 ** 31 - 1, 0, -1, 123456789] * 6000, dtype=torch.int32).reshape(300, 100),
    }
    nan_payload = torch.tensor([0x7E01], dtype=torch.int16).view(torch.float16)  # a non-canonical NaN
    values["dt/f16"].view(-1)[0] = nan_payload[0]
    with PSClient(shared_cluster.cluster, connect_timeout=30, chunk_bytes=codec.MIN_CHUNK_BYTES + 1) as ps:
        assert all(ps.create_variables(values).values())
        pulled = ps.pull(values)
        into = {name: torch.empty_like(v) for name, v in values.items()}
        ps.pull_into(into)
    for name, value in values.items():
        for got in (pulled[name], into[name]):
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert torch.equal(_bits(got), _bits(value)), name
    assert _bits(pulled["dt/f16"]).view(-1)[0].item() == 0x7E01


def test_scalar_and_empty_variables(client):
    """A 0-d variable and variables with no elements can be created, pulled and (if trainable) pushed."""
    values = {
        "shape/scalar": torch.tensor(2.5),
        "shape/empty": torch.zeros(0),
        "shape/empty2d": torch.zeros(3, 0, dtype=torch.int64),
    }
    client.create_variables({"shape/scalar": values["shape/scalar"], "shape/empty": values["shape/empty"]},
                            Optimizer("sgd", lr=1.0))
    client.create_variables({"shape/empty2d": values["shape/empty2d"]})
    pulled = client.pull(values)
    for name, value in values.items():
        assert pulled[name].shape == value.shape and torch.equal(pulled[name], value), name
    client.push({"shape/scalar": torch.tensor(1.0), "shape/empty": torch.zeros(0)})
    after = client.pull(["shape/scalar", "shape/empty"])
    assert after["shape/scalar"].item() == 1.5
    assert after["shape/empty"].shape == (0,)
