"""torchps.wire writes exactly the bytes the generated classes write, and reads what they write."""

import pytest
import torch

from torchps import codec, wire
from torchps.proto import ps_pb2

MIN = codec.MIN_CHUNK_BYTES


def generated_push(header, pieces, end=None) -> bytes:
    """The same PushRequest built with the generated classes."""
    request = ps_pb2.PushRequest()
    if header is not None:
        request.header.CopyFrom(header)
    for name, meta, offset, data, version in pieces:
        chunk = request.chunks.add(name=name, offset=offset, data=bytes(data), version=version)
        if meta is not None:
            chunk.meta.CopyFrom(meta)
    if end is not None:
        request.end.CopyFrom(end)
    return request.SerializeToString()


HEADER = ps_pb2.PushHeader(worker="worker:3", step=7, step_increment=1, incarnation=99, seq=12, tensors=2)
STREAMED = ps_pb2.PushHeader(worker="worker:3", step=7, step_increment=1, incarnation=99, seq=12, streamed=True)


def pieces_of(*named: tuple[str, torch.Tensor], chunk_bytes: int = MIN) -> list:
    return [piece for name, tensor in named for piece in wire.tensor_pieces(name, tensor, chunk_bytes)]


CASES = {
    "header-only": (HEADER, [], None),
    "header-and-chunks": (HEADER, pieces_of(("a", torch.arange(6.0)), ("b", torch.ones(2, 3, dtype=torch.float64))),
                          None),
    "chunks-only": (None, pieces_of(("w", torch.arange(3 * MIN // 4, dtype=torch.float32))), None),
    "streamed-header": (STREAMED, [], None),
    "streamed-end-alone": (None, [], ps_pb2.PushEnd(tensors=5)),
    "streamed-end-zero": (None, [], ps_pb2.PushEnd(tensors=0)),  # an empty PushEnd is still present on the wire
    "streamed-chunks-and-end": (None, pieces_of(("c", torch.arange(4, dtype=torch.int64))), ps_pb2.PushEnd(tensors=1)),
    "streamed-everything": (STREAMED, pieces_of(("s", torch.zeros(()))), ps_pb2.PushEnd(tensors=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_push_request_bytes_equal_the_generated_classes(case):
    header, pieces, end = CASES[case]
    raw = wire.encode_push_request(header, pieces, end)
    assert raw == generated_push(header, pieces, end)
    parsed = ps_pb2.PushRequest.FromString(raw)
    assert parsed.HasField("end") == (end is not None)
    if end is not None:
        assert parsed.end.tensors == end.tensors


@pytest.mark.parametrize("case", list(CASES))
def test_decode_push_request_reads_header_chunks_and_end(case):
    header, pieces, end = CASES[case]
    got_header, chunks, got_end = wire.decode_push_request(generated_push(header, pieces, end))
    assert got_header == header
    assert got_end == end
    assert [(c.name, c.meta, c.offset, bytes(c.data), c.version) for c in chunks] == \
        [(name, meta, offset, bytes(data), version) for name, meta, offset, data, version in pieces]


def test_the_end_field_is_number_3_after_the_chunks():
    """PushRequest.end (field 3, length-delimited) follows the chunks, as the generated classes order fields."""
    raw = wire.encode_push_request(None, pieces_of(("x", torch.ones(1))), ps_pb2.PushEnd(tensors=1))
    assert raw.endswith(b"\x1a\x02\x08\x01")


def test_pull_response_bytes_equal_the_generated_classes():
    pieces = pieces_of(("v", torch.arange(10.0)))
    pieces[0] = pieces[0][:4] + (3,)  # a version on the first chunk
    result = ps_pb2.PushResponse(step=4, next_step=5)
    expected = ps_pb2.PullResponse(step=9, result=result, generation=77)
    for name, meta, offset, data, version in pieces:
        chunk = expected.chunks.add(name=name, offset=offset, data=bytes(data), version=version)
        chunk.meta.CopyFrom(meta)
    raw = wire.encode_pull_response(pieces, 9, result, generation=77)
    assert raw == expected.SerializeToString()
    chunks, step, got, generation = wire.decode_pull_response(raw)
    assert step == 9 and got == result and generation == 77 and bytes(chunks[0].data) == bytes(pieces[0][3])
