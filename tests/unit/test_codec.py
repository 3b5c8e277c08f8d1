"""codec: tensors to chunk streams and back, and the stream rules of ps.proto."""

import numpy as np
import pytest
import torch

from torchps import codec
from torchps.errors import (InvalidArgumentError, MalformedStreamError, TensorMismatchError,
                                      UnknownVariableError)
from torchps.proto import ps_pb2

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sample(dtype, shape=(5, 7)):
    if dtype.is_floating_point:
        return torch.linspace(-3, 3, steps=int(torch.tensor(shape).prod())).reshape(shape).to(dtype)
    return torch.arange(-17, -17 + int(torch.tensor(shape).prod()), dtype=dtype).reshape(shape) * 1_000_003


def _assert_bit_equal(actual, expected):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    bits = _BITS[expected.element_size()]
    assert torch.equal(actual.contiguous().view(bits), expected.contiguous().view(bits))


def _round_trip(name, tensor, chunk_bytes):
    chunks = list(codec.encode_chunks(name, tensor, chunk_bytes))
    assembler = codec.ChunkAssembler(min_chunk=1)
    results = [assembler.add(c) for c in chunks]
    assembler.finish()
    assert all(r is None for r in results[:-1])
    assert results[-1] is not None
    got_name, got = results[-1]
    assert got_name == name
    return chunks, got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 20, 1 << 20])
def test_round_trip_all_dtypes(dtype, chunk_bytes):
    """Every wire dtype survives encode + assemble bit for bit, whatever the chunk size."""
    tensor = _sample(dtype)
    chunks, got = _round_trip("v", tensor, chunk_bytes)
    nbytes = tensor.numel() * tensor.element_size()
    assert len(chunks) == -(-nbytes // chunk_bytes)
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, nbytes, chunk_bytes))
    assert chunks[0].HasField("meta") and not any(c.HasField("meta") for c in chunks[1:])
    assert all(c.name == "v" for c in chunks)
    _assert_bit_equal(got, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_chunk_size_that_divides_the_size(dtype):
    """A tensor of exactly k chunks gives k full chunks and no empty trailing one."""
    tensor = _sample(dtype, (4, 8))  # 32 elements
    chunk_bytes = tensor.element_size() * 8
    chunks, got = _round_trip("even", tensor, chunk_bytes)
    assert [len(c.data) for c in chunks] == [chunk_bytes] * 4
    _assert_bit_equal(got, tensor)


def test_special_float_values_are_bit_exact():
    """NaN payloads, infinities, -0.0 and subnormals are carried as raw bits."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tensor = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1.5], dtype=dtype)
        _, got = _round_trip("special", tensor, 3)
        _assert_bit_equal(got, tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scalar(dtype):
    """A 0-d tensor has an empty shape and one element."""
    tensor = torch.tensor(-3, dtype=dtype)
    chunks, got = _round_trip("s", tensor, 1 << 20)
    assert list(chunks[0].meta.shape) == []
    assert got.shape == ()
    _assert_bit_equal(got, tensor)


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)])
def test_empty_tensor(shape):
    """An empty tensor is one chunk with no data, and completes at once."""
    tensor = torch.empty(shape, dtype=torch.float32)
    chunks, got = _round_trip("e", tensor, 16)
    assert len(chunks) == 1 and chunks[0].data == b""
    assert list(chunks[0].meta.shape) == list(shape)
    assert got.shape == shape


def test_non_contiguous_tensors():
    """Transposed, sliced and expanded tensors arrive with their logical values, row-major."""
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    for tensor in (base.t(), base[::2, 1::3], torch.tensor([1.5, 2.5]).expand(3, 2)):
        assert not tensor.is_contiguous()
        _, got = _round_trip("nc", tensor, 24)
        assert got.is_contiguous()
        assert torch.equal(got, tensor)


def test_meta_and_nbytes():
    meta = codec.meta_of(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert meta.dtype == ps_pb2.BFLOAT16 and list(meta.shape) == [3, 4]
    assert codec.meta_nbytes(meta) == 24
    assert codec.describe_meta(meta) == "bfloat16[3, 4]"
    with pytest.raises(InvalidArgumentError, match="negative dimension"):
        codec.meta_nbytes(ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2, -1]))
    with pytest.raises(InvalidArgumentError, match="unsupported or missing dtype"):
        codec.meta_nbytes(ps_pb2.TensorMeta(shape=[2]))


def test_unsupported_dtype_is_refused():
    with pytest.raises(InvalidArgumentError, match="not supported on the wire"):
        list(codec.encode_chunks("c", torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(InvalidArgumentError, match="chunk_bytes must be positive"):
        list(codec.encode_chunks("c", torch.zeros(2), 0))


def test_several_tensors_in_one_stream():
    """Tensors follow one another; each completes on its last chunk."""
    a, b = torch.arange(10, dtype=torch.int32), torch.ones(3, 3)
    assembler = codec.ChunkAssembler(min_chunk=1)
    done = [r for c in [*codec.encode_chunks("a", a, 8), *codec.encode_chunks("b", b, 8)]
            if (r := assembler.add(c)) is not None]
    assembler.finish()
    assert [n for n, _ in done] == ["a", "b"]
    assert torch.equal(done[0][1], a) and torch.equal(done[1][1], b)


# -- stream errors -------------------------------------------------------------------------------

def _chunks(name="v", n=16, chunk_bytes=16):
    return list(codec.encode_chunks(name, torch.arange(n, dtype=torch.float32), chunk_bytes))  # 4 chunks


def _feed(chunks, assembler=None):
    assembler = assembler or codec.ChunkAssembler(min_chunk=1)
    for chunk in chunks:
        assembler.add(chunk)
    assembler.finish()


def test_missing_chunk():
    c = _chunks()
    with pytest.raises(MalformedStreamError, match="expected"):
        _feed([c[0], c[1], c[3]])


def test_missing_last_chunk_then_next_tensor():
    c = _chunks()
    with pytest.raises(MalformedStreamError, match="chunks are missing"):
        _feed([*c[:3], *_chunks("w")])


def test_out_of_order_chunks():
    c = _chunks()
    with pytest.raises(MalformedStreamError, match="out of order"):
        _feed([c[0], c[2], c[1], c[3]])
    with pytest.raises(MalformedStreamError, match="offset 16, expected 0"):
        _feed([c[1], c[0], c[2], c[3]])


def test_duplicated_chunk():
    c = _chunks()
    with pytest.raises(MalformedStreamError, match="duplicated"):
        _feed([c[0], c[1], c[1], c[2], c[3]])
    with pytest.raises(MalformedStreamError, match="duplicated"):
        _feed([c[0], c[0], c[1], c[2], c[3]])  # a second first chunk (with meta)


def test_overrun_past_declared_size():
    c = _chunks()
    c[3] = ps_pb2.TensorChunk(name="v", offset=48, data=bytes(17))
    with pytest.raises(MalformedStreamError, match="past the 64 bytes"):
        _feed(c)
    first = ps_pb2.TensorChunk(name="s", meta=codec.meta_of(torch.zeros(2)), offset=0, data=bytes(12))
    with pytest.raises(MalformedStreamError, match="past the 8 bytes"):
        _feed([first])


def test_stream_ends_mid_tensor():
    """finish() refuses a stream that stopped inside a tensor; add() alone never completes it."""
    c = _chunks()
    assembler = codec.ChunkAssembler(min_chunk=1)
    assert all(assembler.add(chunk) is None for chunk in c[:3])
    with pytest.raises(MalformedStreamError, match="incomplete: 48 of 64 bytes"):
        assembler.finish()


def test_first_chunk_without_meta():
    c = _chunks()
    c[0].ClearField("meta")
    with pytest.raises(MalformedStreamError, match="carries no meta"):
        _feed(c)


def test_meta_given_by_the_caller():
    """A first chunk without meta is fine when add() is given the meta (CreateVariables)."""
    tensor = torch.arange(16, dtype=torch.float32)
    c = list(codec.encode_chunks("v", tensor, 16))
    c[0].ClearField("meta")
    assembler = codec.ChunkAssembler(min_chunk=1)
    out = [assembler.add(chunk, meta=codec.meta_of(tensor)) for chunk in c]
    assert torch.equal(out[-1][1], tensor)


def test_chunk_meta_contradicting_the_given_meta():
    c = _chunks()
    with pytest.raises(TensorMismatchError, match="spec says float32\\[4\\]"):
        codec.ChunkAssembler(min_chunk=1).add(c[0], meta=codec.meta_of(torch.zeros(4)))


def test_name_appearing_twice():
    with pytest.raises(MalformedStreamError, match="appears twice"):
        _feed([*_chunks("v"), *_chunks("w"), *_chunks("v")])


def test_chunk_without_name():
    c = _chunks()
    c[0].name = ""
    with pytest.raises(MalformedStreamError, match="without a variable name"):
        _feed(c)


def test_bad_meta_in_first_chunk():
    chunk = ps_pb2.TensorChunk(name="v", meta=ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[-4]))
    with pytest.raises(InvalidArgumentError, match="negative dimension"):
        codec.ChunkAssembler(min_chunk=1).add(chunk)


def test_begin_sees_each_tensor_once():
    seen = []
    assembler = codec.ChunkAssembler(begin=lambda name, meta: seen.append((name, codec.describe_meta(meta))), min_chunk=1)
    _feed([*_chunks("a"), *_chunks("b", n=2)], assembler)
    assert seen == [("a", "float32[16]"), ("b", "float32[2]")]


def test_begin_rejects_before_allocation(monkeypatch):
    """A begin() that raises stops the stream before any buffer is allocated, even an impossible one."""
    allocations = []
    real_empty = codec.np.empty
    monkeypatch.setattr(codec.np, "empty", lambda *a, **k: allocations.append(a) or real_empty(*a, **k))

    def begin(name, meta):
        raise UnknownVariableError(f"no variable {name!r}")

    huge = ps_pb2.TensorChunk(name="huge", meta=ps_pb2.TensorMeta(dtype=ps_pb2.INT64, shape=[1 << 40, 1 << 20]))
    assembler = codec.ChunkAssembler(begin=begin, min_chunk=1)
    with pytest.raises(UnknownVariableError, match="'huge'"):
        assembler.add(huge)
    assert allocations == []
    with pytest.raises(InvalidArgumentError, match="cannot allocate"):  # without begin: refused, not a crash
        codec.ChunkAssembler(min_chunk=1).add(huge)


def test_chunks_below_the_minimum_are_refused_unless_last():
    """Every chunk of a tensor but its last carries at least min_chunk bytes (ps.proto)."""
    tensor = torch.arange(64, dtype=torch.float32)  # 256 bytes
    with pytest.raises(MalformedStreamError, match="at least 128 bytes"):
        for chunk in codec.encode_chunks("v", tensor, 64):
            codec.ChunkAssembler(min_chunk=128).add(chunk)
    assembler = codec.ChunkAssembler(min_chunk=128)
    done = [assembler.add(c) for c in codec.encode_chunks("v", tensor, 200)]  # 200 + a last chunk of 56
    assert done[0] is None and torch.equal(done[1][1], tensor)


def test_check_chunk_bytes_bounds():
    codec.check_chunk_bytes(codec.MIN_CHUNK_BYTES)
    for bad in (0, 1, codec.MIN_CHUNK_BYTES - 1, codec.DEFAULT_MAX_CHUNK_BYTES + 1):
        with pytest.raises(InvalidArgumentError, match="chunk_bytes must be in"):
            codec.check_chunk_bytes(bad)


def test_an_empty_tensor_made_by_numpy_has_no_bytes_and_no_error():
    empty = torch.from_numpy(np.arange(4)[np.flatnonzero(np.zeros(0))])  # numpy gives it a zero stride
    assert empty.stride() == (0,) and len(codec.tensor_bytes(empty)) == 0 and codec.byte_array(empty).size == 0
