"""compression: the policy and its parsing, the worker's encoder with error feedback, the shard's checks and
decoder, and the codec's SPARSE sizes. No processes."""

import math

import numpy as np
import pytest
import torch

from torchps import codec, compression
from torchps.compression import Compression, Encoded, Encoder, Residuals
from torchps.errors import ClusterConfigError, InvalidArgumentError, MalformedStreamError, TensorMismatchError
from torchps.proto import ps_pb2

ALL = dict(min_bytes=0)


def grad(n: int = 1000, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def wire(encoded: Encoded) -> np.ndarray:
    """The bytes a shard assembles for an encoded tensor, checked against the size its meta declares."""
    raw = codec.byte_array(encoded.payload).copy()
    assert len(raw) == codec.meta_nbytes(encoded.meta)
    return raw


def decoded(name: str, encoded: Encoded, like: torch.Tensor) -> torch.Tensor:
    variable = codec.meta_of(like)
    compression.check_gradient_meta(name, encoded.meta, variable)
    return compression.decode(name, encoded.meta, wire(encoded), variable)


# -- the policy -------------------------------------------------------------------------------------------------


def test_defaults_and_pull_policy():
    assert Compression().kind == "none" and Compression().pull == "none"
    assert Compression("bf16").pull == "bf16" and Compression("fp16").pull == "fp16"
    assert Compression("topk").pull == "none" and Compression("topk", pull="bf16").pull == "bf16"
    assert Compression().min_bytes == 64 * 1024 and Compression().ratio == 0.01


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(kind="zip"), "must be one of"),
    (dict(kind="topk", ratio=0), "ratio must be in (0, 1]"),
    (dict(kind="topk", ratio=1.5), "ratio must be in (0, 1]"),
    (dict(kind="topk", ratio=math.nan), "ratio must be in (0, 1]"),
    (dict(kind="topk", ratio=True), "ratio must be in (0, 1]"),
    (dict(min_bytes=-1), "min_bytes must be an integer >= 0"),
    (dict(warmup_steps=1.5), "warmup_steps must be an integer >= 0"),
    (dict(error_feedback=1), "error_feedback must be True or False"),
    (dict(kind="topk", pull="topk"), "pull must be none, bf16 or fp16"),
])
def test_bad_policies_are_refused(kwargs, fragment):
    with pytest.raises(ClusterConfigError, match=fragment.replace("(", r"\(").replace("]", r"\]")):
        Compression(**kwargs)


def test_parse():
    assert Compression.parse("bf16") == Compression("bf16")
    assert Compression.parse("topk:0.01") == Compression("topk", ratio=0.01)
    assert Compression.parse("randomk:0.05, min_bytes=0, warmup=10, pull=BF16, error_feedback=0, seed=3") == \
        Compression("randomk", 0.05, min_bytes=0, warmup_steps=10, pull="bf16", error_feedback=False, seed=3)


@pytest.mark.parametrize("spec", ["", "zip", "topk:x", "topk:0", "topk,ratio=0.1", "bf16,warmup", "bf16,warmup=x",
                                  "topk,error_feedback=yes"])
def test_parse_refuses_malformed_specs(spec):
    with pytest.raises(ClusterConfigError):
        Compression.parse(spec)


def test_policies_for_module_names():
    names = ["enc.weight", "enc.bias", "dec.weight"]
    topk, bf16 = Compression("topk"), Compression("bf16")
    assert compression.policies_for(names, bf16) == dict.fromkeys(names, bf16)
    assert compression.policies_for(names, {"enc.": topk, "enc.bias": bf16}) == {"enc.weight": topk, "enc.bias": bf16}
    with pytest.raises(ClusterConfigError, match="match no parameter"):
        compression.policies_for(names, {"encoder.": topk})
    with pytest.raises(ClusterConfigError):
        compression.policies_for(names, "bf16")


# -- encoding ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind, narrow, eps", [("bf16", torch.bfloat16, 2.0 ** -8),
                                               ("fp16", torch.float16, 2.0 ** -11)])
def test_casts_round_trip_within_their_precision(dtype, kind, narrow, eps):
    g = grad(dtype=dtype)
    sent, residual = compression.encode(Compression(kind, **ALL), "w", g, 0, None)
    assert residual is None and sent.meta.dtype == codec.wire_dtype(narrow) and sent.meta.encoding == ps_pb2.DENSE
    back = decoded("w", sent, g)
    assert back.dtype == dtype and torch.equal(back, g.to(narrow).to(dtype))
    assert ((back - g).abs() <= eps * g.abs()).all()


@pytest.mark.parametrize("policy, tensor, step", [
    (Compression("bf16", min_bytes=4001), grad(1000), 0),           # 4000 bytes: under min_bytes
    (Compression("topk", warmup_steps=5, **ALL), grad(1000), 4),     # warming up
    (Compression("bf16", **ALL), torch.arange(1000), 0),             # not a float
    (Compression("bf16", **ALL), grad(1000).half(), 0),              # already 16 bits: casts are of fp32/fp64
    (Compression("fp16", **ALL), torch.full((1000,), 1e5), 0),       # would overflow fp16
    (Compression(**ALL), grad(1000), 0),
], ids=["min-bytes", "warmup", "int", "fp16-variable", "fp16-overflow", "none"])
def test_what_travels_uncompressed(policy, tensor, step):
    sent, residual = compression.encode(policy, "w", tensor, step, None)
    assert sent is tensor or torch.equal(sent, tensor)
    assert isinstance(sent, torch.Tensor) and residual is None


def test_topk_sends_the_largest_magnitudes_in_index_order():
    g = grad()
    sent, residual = compression.encode(Compression("topk", ratio=0.05, **ALL), "w", g, 0, None)
    assert sent.meta.encoding == ps_pb2.SPARSE and sent.meta.nnz == 50
    raw = wire(sent)
    index = torch.from_numpy(raw[:200].copy()).view(torch.int32)
    assert index.tolist() == sorted(g.abs().topk(50).indices.tolist())
    expected = torch.zeros_like(g)
    expected[index.long()] = g[index.long()]
    assert torch.equal(decoded("w", sent, g), expected)
    assert torch.equal(residual, g - expected)


def test_error_feedback_loses_nothing():
    """Sum of what was sent + the last residual == sum of the gradients (topk and randomk)."""
    for kind in ("topk", "randomk"):
        encoder, total_sent = Encoder(), torch.zeros(40, 25)
        encoder.set_policies({"w": Compression(kind, ratio=0.03, **ALL)})
        grads = [grad(1000, seed=s).reshape(40, 25) for s in range(6)]
        for step, g in enumerate(grads):
            sent, left = encoder.encode_all({"w": g}, step)
            total_sent += decoded("w", sent["w"], g)
            encoder.commit(left, ["w"])
        assert torch.allclose(total_sent + encoder.residuals.get("w"), sum(grads), atol=1e-5), kind


def test_without_error_feedback_nothing_is_kept():
    sent, residual = compression.encode(Compression("topk", ratio=0.1, error_feedback=False, **ALL), "w", grad(), 0,
                                        torch.ones(1000))
    assert residual is None and sent.meta.nnz == 100


def test_randomk_is_deterministic_per_seed_step_and_name():
    def index(seed, step, name):
        sent, _ = compression.encode(Compression("randomk", ratio=0.1, seed=seed, **ALL), name, grad(), step, None)
        count = sent.meta.nnz
        return torch.from_numpy(wire(sent)[:4 * count].copy()).view(torch.int32).tolist()

    first = index(0, 7, "w")
    assert first == index(0, 7, "w") and first == sorted(set(first))
    assert first != index(0, 8, "w") and first != index(0, 7, "v") and first != index(1, 7, "w")


def test_dense_when_sparse_would_not_be_smaller():
    """At ratio 0.5 indices + values outweigh the dense tensor: it goes dense, gradient + residual, residual cleared."""
    g, old = grad(), grad(seed=1)
    sent, residual = compression.encode(Compression("topk", ratio=0.5, **ALL), "w", g, 0, old)
    assert isinstance(sent, torch.Tensor) and torch.equal(sent, g + old) and not residual.any()


def test_encoder_commits_only_what_was_applied():
    encoder = Encoder()
    encoder.set_policies({"a": Compression("topk", **ALL), "b": Compression("topk", **ALL)})
    sent, left = encoder.encode_all({"a": grad(), "b": grad(seed=1), "c": grad(seed=2)}, 0)
    assert isinstance(sent["a"], Encoded) and isinstance(sent["c"], torch.Tensor) and set(left) == {"a", "b"}
    assert len(encoder.residuals) == 0  # nothing kept before a shard applied it
    encoder.commit(left, ["a", "c"])
    assert encoder.residuals.get("a") is left["a"] and encoder.residuals.get("b") is None
    with pytest.raises(ClusterConfigError):
        encoder.set_policies({"a": "topk"})


def test_pull_casts():
    encoder = Encoder()
    encoder.set_policies({"w": Compression("bf16", min_bytes=100, warmup_steps=2), "t": Compression("topk", **ALL)})
    targets = {"w": torch.zeros(100), "t": torch.zeros(100), "x": torch.zeros(100), "small": torch.zeros(3)}
    assert encoder.pull_casts(targets, 1) == []  # warming up
    assert encoder.pull_casts(targets, 2) == [ps_pb2.BFLOAT16, 0, 0, 0]
    assert encoder.pull_casts({"w": torch.zeros(100, dtype=torch.int64)}, 2) == []


def test_residuals_state_dict_round_trip():
    residuals = Residuals()
    residuals.set("w", grad())
    saved = residuals.state_dict()
    restored = Residuals()
    restored.load_state_dict(saved)
    assert torch.equal(restored.get("w"), residuals.get("w")) and len(restored) == 1
    with pytest.raises(ClusterConfigError):
        restored.load_state_dict({"w": torch.arange(3)})
    assert len(restored) == 1


def test_a_residual_of_another_shape_is_refused():
    with pytest.raises(TensorMismatchError, match="residual of 'w'"):
        compression.encode(Compression("topk", **ALL), "w", grad(), 0, torch.zeros(10))


# -- the shard's side -------------------------------------------------------------------------------------------


def sparse_meta(nnz: int, shape=(1000,), dtype=ps_pb2.FLOAT32) -> ps_pb2.TensorMeta:
    return ps_pb2.TensorMeta(dtype=dtype, shape=list(shape), encoding=ps_pb2.SPARSE, nnz=nnz)


def test_meta_nbytes_of_sparse_tensors():
    assert codec.meta_nbytes(sparse_meta(3)) == 3 * (4 + 4)
    assert codec.meta_nbytes(sparse_meta(3, dtype=ps_pb2.FLOAT64)) == 3 * (4 + 8)
    assert codec.meta_nbytes(sparse_meta(3, shape=(2 ** 31,))) == 3 * (8 + 4)  # int64 indices
    assert compression.index_dtype(2 ** 31 - 1) == torch.int32 and compression.index_dtype(2 ** 31) == torch.int64
    for bad, fragment in [(sparse_meta(0), "nnz must be"), (sparse_meta(1001), "nnz must be"),
                          (ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[3], nnz=1), "nnz is for SPARSE"),
                          (ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[3], encoding=5), "unknown encoding")]:
        with pytest.raises(InvalidArgumentError, match=fragment):
            codec.meta_nbytes(bad)


def raw_sparse(index, values, index_dtype=torch.int32, dtype=torch.float32) -> np.ndarray:
    return np.frombuffer(torch.tensor(index, dtype=index_dtype).numpy().tobytes()
                         + torch.tensor(values, dtype=dtype).view(torch.int16 if dtype.itemsize == 2 else dtype)
                         .numpy().tobytes(), dtype=np.uint8).copy()


@pytest.mark.parametrize("index, fragment", [([5, 1000], "out of range"), ([-3, 5], "out of range"),
                                             ([5, 5], "strictly increasing"), ([9, 5], "strictly increasing")])
def test_decode_refuses_bad_indices(index, fragment):
    variable = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[1000])
    with pytest.raises(InvalidArgumentError, match=fragment):
        compression.decode("w", sparse_meta(2), raw_sparse(index, [1.0, 2.0]), variable)


def test_decode_casts_up_narrow_sparse_values_and_odd_alignment():
    """bf16 values into a float64 variable; an odd nnz puts float64 values off their alignment."""
    variable = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT64, shape=[10, 100])
    out = compression.decode("w", sparse_meta(3, (10, 100), ps_pb2.BFLOAT16),
                             raw_sparse([0, 7, 999], [1.5, -2.0, 3.0], dtype=torch.bfloat16), variable)
    assert out.dtype == torch.float64 and out.shape == (10, 100) and out.sum() == 2.5 and out[9, 99] == 3.0
    out = compression.decode("w", sparse_meta(3, (10, 100), ps_pb2.FLOAT64),
                             raw_sparse([0, 7, 999], [1.5, -2.0, 3.0], dtype=torch.float64), variable)
    assert out.flatten()[7] == -2.0


@pytest.mark.parametrize("meta, variable", [
    (ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT16, shape=[4]), ps_pb2.TensorMeta(dtype=ps_pb2.INT64, shape=[4])),
    (ps_pb2.TensorMeta(dtype=ps_pb2.BFLOAT16, shape=[4]), ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT16, shape=[4])),
    (ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[4]), ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT64, shape=[4])),
    (sparse_meta(1, (5,)), ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[4])),
])
def test_gradient_metas_that_do_not_fit(meta, variable):
    with pytest.raises(TensorMismatchError, match="gradient for 'w'"):
        compression.check_gradient_meta("w", meta, variable)


def test_pull_dtype():
    fp32, i64 = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2]), ps_pb2.TensorMeta(dtype=ps_pb2.INT64, shape=[2])
    assert compression.pull_dtype("w", fp32, ps_pb2.DTYPE_UNSPECIFIED) is None
    assert compression.pull_dtype("w", fp32, ps_pb2.BFLOAT16) == torch.bfloat16
    for variable, cast in [(i64, ps_pb2.FLOAT16), (fp32, ps_pb2.FLOAT32), (fp32, 42)]:
        with pytest.raises(TensorMismatchError, match="cannot pull 'w'"):
            compression.pull_dtype("w", variable, cast)


def test_cast_bytes_of_whole_elements():
    value = grad(8)
    out = compression.cast_bytes(codec.tensor_bytes(value)[8:24], torch.float32, torch.float16)
    assert torch.equal(torch.frombuffer(bytearray(out), dtype=torch.float16), value[2:6].half())


def test_the_assembler_takes_sparse_tensors_only_with_a_decoder():
    chunk = ps_pb2.TensorChunk(name="w", meta=sparse_meta(1), offset=0, data=raw_sparse([4], [2.0]).tobytes())
    with pytest.raises(InvalidArgumentError, match="for pushes only"):
        codec.ChunkAssembler(min_chunk=1).add(chunk)
    variable = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[1000])
    assembler = codec.ChunkAssembler(min_chunk=1, decode=lambda name, meta, raw: compression.decode(
        name, meta, raw, variable))
    name, tensor = assembler.add(chunk)
    assert name == "w" and tensor[4] == 2.0 and tensor.sum() == 2.0
    with pytest.raises(MalformedStreamError, match="past the 8 bytes"):
        codec.ChunkAssembler(min_chunk=1, decode=lambda *a: None).add(ps_pb2.TensorChunk(
            name="w", meta=sparse_meta(1), offset=0, data=bytes(12)))


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.02])
def test_top_k_indices_is_torch_topks_set_on_a_large_tensor(ratio):
    magnitudes = torch.randn(1 << 21, generator=torch.Generator().manual_seed(3)).abs()
    k = math.ceil(ratio * magnitudes.numel())
    expected = torch.topk(magnitudes, k, sorted=False).indices.sort().values
    assert torch.equal(compression.top_k_indices(magnitudes, k), expected)


def test_top_k_indices_falls_back_to_the_whole_when_the_sample_misjudges():
    magnitudes = torch.rand(1 << 16, generator=torch.Generator().manual_seed(5))
    k, sample = 1000, 8
    # plant the largest values where the sample is drawn: the bound lands above the k-th largest
    drawn = torch.randint(magnitudes.numel(), (sample,), generator=torch.Generator().manual_seed(magnitudes.numel()))
    magnitudes[drawn] = 10.0 + torch.arange(sample, dtype=torch.float32)
    assert int((magnitudes >= compression.candidate_bound(magnitudes, k, sample)).sum()) < k  # the scenario
    expected = torch.topk(magnitudes, k, sorted=False).indices.sort().values
    assert torch.equal(compression.top_k_indices(magnitudes, k, sample=sample), expected)


def test_top_k_indices_keeps_tied_values_at_the_boundary():
    magnitudes = torch.randint(0, 50, (1 << 21,), generator=torch.Generator().manual_seed(4)).float()
    k = 20_000
    picked = magnitudes[compression.top_k_indices(magnitudes, k)]
    assert picked.numel() == k and torch.equal(picked.sort().values, magnitudes.topk(k).values.sort().values)


def test_a_cast_is_written_into_the_last_push_s_buffer_once_that_push_let_go():
    encoder = Encoder()
    encoder.set_policies({"w": Compression("bf16", **ALL)})
    sent, _ = encoder.encode_all({"w": grad(1000)}, 0)
    held, _ = encoder.encode_all({"w": grad(1000)}, 1)  # the first push still holds its bytes: new memory
    assert held["w"].payload.data_ptr() != sent["w"].payload.data_ptr()
    last = held["w"].payload.data_ptr()
    del sent, held
    decoy = torch.empty(1000, dtype=torch.bfloat16)  # takes the last push's memory, were it freed
    values = grad(1000)
    again, _ = encoder.encode_all({"w": values}, 2)
    assert again["w"].payload.data_ptr() == last
    assert torch.equal(again["w"].payload, values.to(torch.bfloat16)) and decoy.data_ptr() != last
