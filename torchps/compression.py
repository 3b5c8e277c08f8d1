"""Wire compression: the per-variable policy, the worker's encoder and the shard's decoder. No gRPC here.

Encodings (ps.proto's TensorMeta):
* a cast: DENSE bytes of FLOAT16 or BFLOAT16 for a FLOAT32 or FLOAT64
  variable, both ways (gradients pushed, values pulled); the shard casts a
  gradient up, so values and optimizer state stay in the variable's dtype;
* SPARSE (top-k, random-k; pushes only): `nnz` flat indices, strictly
  increasing, int32 (int64 for 2^31 elements or more), then `nnz` values;
  elements not listed are 0. What a worker leaves out is its residual
  (error feedback), added to the variable's next gradient.

`Compression` is the policy, `Encoder` applies it for a worker (a policy per
wire variable name, the residuals), `check_gradient_meta`, `decode` and
`pull_dtype` are what a shard checks and decodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from typing import Callable, Mapping, NamedTuple

import numpy as np
import torch

from . import codec
from .errors import ClusterConfigError, InvalidArgumentError, TensorMismatchError
from .proto import ps_pb2

__all__ = ["KINDS", "DEFAULT_MIN_BYTES", "Compression", "policies_for", "Encoded", "Residuals", "Encoder", "encode",
           "index_dtype", "check_gradient_meta", "sparse_parts", "decode", "pull_dtype", "cast_bytes",
           "SUPPORT_ATTRIBUTE"]

KINDS = ("none", "bf16", "fp16", "topk", "randomk")
SUPPORT_ATTRIBUTE = "torchps_support"  # decode's SPARSE gradients: the flat indices they were built from
DEFAULT_MIN_BYTES = 64 << 10  # smaller tensors travel as they are: the saving would not pay for the work
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ONLY_HERE = 2  # sys.getrefcount of a tensor only a local variable holds: it and getrefcount's argument
_WIDE = (ps_pb2.FLOAT32, ps_pb2.FLOAT64)      # variables that may travel cast
_NARROW = (ps_pb2.FLOAT16, ps_pb2.BFLOAT16)   # what they may travel as


@dataclasses.dataclass(frozen=True)
class Compression:
    """How one variable travels: `kind` for its gradients, `pull` for its values.

        Compression("bf16")                      # bf16 both ways
        Compression("topk", ratio=0.01)          # 1% of each gradient, the rest fed back; pulls as stored
        Compression("randomk", 0.05, pull="bf16", warmup_steps=100)

    kind: "none", "bf16", "fp16" (casts of float32/float64 gradients),
    "topk" (the `ratio` largest magnitudes of gradient + residual) or
    "randomk" (a `ratio` of the elements drawn at random, deterministic per
    (seed, step, variable)). With error_feedback (topk, randomk) what is left
    out is kept by the worker and added to the next gradient. pull: "none",
    "bf16" or "fp16" for values pulled in place (default: the cast of `kind`,
    else "none"). Tensors under `min_bytes` and every step before
    `warmup_steps` travel uncompressed. ClusterConfigError for a bad value.
    """

    kind: str = "none"
    ratio: float = 0.01
    min_bytes: int = DEFAULT_MIN_BYTES
    warmup_steps: int = 0
    error_feedback: bool = True
    pull: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ClusterConfigError(f"compression must be one of {', '.join(KINDS)}. Received: {self.kind!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ClusterConfigError(f"compression ratio must be in (0, 1]. Received: {self.ratio!r}")
        for field in ("min_bytes", "warmup_steps", "seed"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ClusterConfigError(f"compression {field} must be an integer >= 0. Received: {value!r}")
        if not isinstance(self.error_feedback, bool):
            raise ClusterConfigError(f"compression error_feedback must be True or False. "
                                     f"Received: {self.error_feedback!r}")
        if self.pull is None:
            object.__setattr__(self, "pull", self.kind if self.kind in _CASTS else "none")
        if self.pull not in ("none", *_CASTS):
            raise ClusterConfigError(f"compression pull must be none, bf16 or fp16. Received: {self.pull!r}")

    @classmethod
    def parse(cls, spec: str) -> "Compression":
        """From ps-worker's --compression: `KIND[:RATIO][,min_bytes=N][,warmup=N][,pull=P][,error_feedback=0|1]
        [,seed=N]`, e.g. "bf16", "topk:0.01", "randomk:0.05,warmup=100". ClusterConfigError if malformed."""
        head, *options = [part.strip() for part in spec.split(",")]
        kind, _, ratio = head.partition(":")
        kwargs: dict = {"kind": kind.strip().lower()}
        try:
            if ratio:
                kwargs["ratio"] = float(ratio)
            for option in options:
                key, sep, value = option.partition("=")
                key = {"warmup": "warmup_steps"}.get(key.strip(), key.strip())
                if not sep or key not in ("min_bytes", "warmup_steps", "pull", "error_feedback", "seed"):
                    raise ClusterConfigError(f"unknown option {option!r} (min_bytes=, warmup=, pull=, "
                                             f"error_feedback=, seed=)")
                value = value.strip()
                if key == "pull":
                    kwargs[key] = value.lower()
                elif key == "error_feedback":
                    if value not in ("0", "1"):
                        raise ClusterConfigError(f"error_feedback must be 0 or 1. Received: {value!r}")
                    kwargs[key] = value == "1"
                else:
                    kwargs[key] = int(value)
        except ValueError as exc:
            raise ClusterConfigError(f"compression {spec!r}: {exc}") from None
        return cls(**kwargs)

    def applies(self, nbytes: int, step: int) -> bool:
        """True if a tensor of `nbytes` (as stored) is compressed at `step`."""
        return nbytes >= self.min_bytes and step >= self.warmup_steps


def policies_for(names: list[str], compression: Compression | Mapping[str, Compression]) -> dict[str, Compression]:
    """{name: policy}: one Compression for every name, or {name or prefix: Compression}, the longest key a name
    starts with winning (names matching no key get none). ClusterConfigError for a key matching no name."""
    if isinstance(compression, Compression):
        return {name: compression for name in names}
    if not isinstance(compression, Mapping):
        raise ClusterConfigError(f"compression must be a Compression or a {{name or prefix: Compression}} mapping. "
                                 f"Received: {type(compression).__name__}")
    unused = [key for key in compression if not any(name.startswith(key) for name in names)]
    if unused:
        raise ClusterConfigError(f"compression keys {unused[:3]} match no parameter name (names are like "
                                 f"{names[:3]})")
    out = {}
    for name in names:
        keys = [key for key in compression if name.startswith(key)]
        if keys:
            out[name] = compression[max(keys, key=len)]
    return out


class Encoded(NamedTuple):
    """A tensor as it goes on the wire compressed: its meta, and a contiguous CPU tensor holding its bytes."""

    meta: ps_pb2.TensorMeta
    payload: torch.Tensor


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of SPARSE indices into a tensor of `numel` elements (ps.proto)."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


def _castable(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """True if every element is finite and within `dtype`'s largest finite value (one pass, no allocation: a
    NaN makes both comparisons false)."""
    if not tensor.numel():
        return True
    low, high = torch.aminmax(tensor)
    limit = torch.finfo(dtype).max
    return bool(low >= -limit) and bool(high <= limit)


def _kept(buffer: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`buffer` if it has `like`'s shape and device and `dtype`, else a new tensor that has."""
    if buffer is not None and buffer.shape == like.shape and buffer.dtype == dtype and buffer.device == like.device:
        return buffer
    return torch.empty(like.shape, dtype=dtype, device=like.device)


def encode(policy: Compression, name: str, grad: torch.Tensor, step: int, residual: torch.Tensor | None,
           cast_buffer: torch.Tensor | None = None) -> tuple[torch.Tensor | Encoded, torch.Tensor | None]:
    """(what to send for `grad` at `step`, the residual to keep once it is applied, or None: keep the old one).

    What to send is `grad` itself (uncompressed: kind none, a non-float
    tensor, under min_bytes, warm-up, or a cast that would overflow fp16) or
    Encoded. `residual` (same shape and dtype) is added first with error
    feedback. A cast is written into `cast_buffer` where it fits (the last
    push's cast of this name, whose push is over). Never blocks; touches
    neither `grad` nor `residual`.
    """
    grad = grad.detach()
    if (policy.kind == "none" or not grad.is_floating_point()
            or not policy.applies(grad.numel() * grad.element_size(), step)):
        return grad, None
    if policy.kind in _CASTS:
        narrow_dtype = _CASTS[policy.kind]
        if codec.wire_dtype(grad.dtype) not in _WIDE or not _castable(grad, narrow_dtype):
            return grad, None  # fp16 overflow (or a NaN the shard will name): sent as it is
        narrow = _kept(cast_buffer, grad, narrow_dtype).copy_(grad)
        return Encoded(codec.meta_of(narrow), narrow.cpu().contiguous()), None
    flat = grad.reshape(-1)
    numel = flat.numel()
    if residual is not None and policy.error_feedback:
        if residual.shape != grad.shape or residual.dtype != grad.dtype:
            raise TensorMismatchError(f"the residual of {name!r} is {residual.dtype}{list(residual.shape)} but its "
                                      f"gradient is {grad.dtype}{list(grad.shape)}: load residuals of this model")
        accumulated = flat + residual.to(flat.device).reshape(-1)
    else:
        accumulated = flat.clone()
    k = min(numel, max(1, math.ceil(policy.ratio * numel)))
    itemsize = grad.element_size()
    if k * (index_dtype(numel).itemsize + itemsize) >= numel * itemsize:  # dense is no bigger
        return accumulated.view(grad.shape), (torch.zeros_like(grad) if policy.error_feedback else None)
    if policy.kind == "topk":
        index = top_k_indices(accumulated.abs(), k)
    else:
        generator = torch.Generator(device=accumulated.device).manual_seed(_seed(policy.seed, step, name))
        index = torch.randint(numel, (k,), generator=generator, device=accumulated.device).unique()  # sorted
    values = accumulated[index]
    left = None
    if policy.error_feedback:
        accumulated[index] = 0
        left = accumulated.view(grad.shape)
    payload = torch.cat([index.to(index_dtype(numel)).cpu().view(torch.uint8),
                         values.cpu().contiguous().view(torch.uint8)])
    meta = ps_pb2.TensorMeta(dtype=codec.wire_dtype(grad.dtype), shape=list(grad.shape), encoding=ps_pb2.SPARSE,
                             nnz=len(index))
    return Encoded(meta, payload), left


def top_k_indices(magnitudes: torch.Tensor, k: int, sample: int = 65_536) -> torch.Tensor:
    """The sorted indices of the k largest of a 1-D tensor: torch.topk's set (ties aside), several times faster.

    For a large tensor and a small k it first keeps the candidates at or above
    candidate_bound (twice-k's quantile estimated from `sample` random
    elements, below the k-th largest by a wide statistical margin), then runs
    torch.topk on those only; if the sample misjudged and fewer than k
    remain, it falls back to torch.topk on the whole. Exact either way.
    """
    numel = magnitudes.numel()
    if numel < 16 * sample or k > numel // 50:
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    candidates = torch.nonzero(magnitudes >= candidate_bound(magnitudes, k, sample)).view(-1)
    if candidates.numel() < k:
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices].sort().values


def candidate_bound(magnitudes: torch.Tensor, k: int, sample: int) -> torch.Tensor:
    """top_k_indices's bound: the value 2k of `magnitudes` would reach, judged from `sample` elements drawn
    with a generator seeded by the size (the same tensor gets the same bound)."""
    numel = magnitudes.numel()
    generator = torch.Generator(device=magnitudes.device).manual_seed(numel)
    drawn = magnitudes[torch.randint(numel, (sample,), generator=generator, device=magnitudes.device)]
    return torch.kthvalue(drawn, sample - min(sample, math.ceil(2 * k * sample / numel)) + 1).values


def _seed(seed: int, step: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{step}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Residuals:
    """Error feedback: per wire variable name, what top-k or random-k left unsent (on the gradient's device)."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor | None:
        return self._values.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        self._values[name] = value

    def __len__(self) -> int:
        return len(self._values)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{name: residual}, copied to CPU (for torch.save)."""
        return {name: value.detach().cpu().clone() for name, value in self._values.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replaces every residual with `state`'s; ClusterConfigError (nothing replaced) if it is not
        {name: floating-point tensor}."""
        bad = [name for name, value in state.items() if not isinstance(name, str)
               or not isinstance(value, torch.Tensor) or not value.is_floating_point()]
        if bad:
            raise ClusterConfigError(f"not a residual state_dict: {bad[:3]} are not name: float tensor entries")
        self._values = {name: value.detach().clone() for name, value in state.items()}


class Encoder:
    """A worker's side of compression: a policy per wire variable name and the residuals.

    Pushes are encoded once (`encode_all`) and their residuals kept as each
    shard applies its part (`commit`), so a retried push resends the same
    bytes and a failed one leaves the residuals as they were. Not
    thread-safe for one name: one push at a time (PSClient's push lock).
    """

    def __init__(self) -> None:
        self.policies: dict[str, Compression] = {}
        self.residuals = Residuals()
        self._cast_buffers: dict[str, torch.Tensor] = {}  # name -> its last cast, memory for the next one

    def set_policies(self, policies: Mapping[str, Compression]) -> None:
        """Sets the policy of each name (others keep theirs); ClusterConfigError (nothing set) for a non-Compression."""
        bad = [name for name, policy in policies.items() if not isinstance(policy, Compression)]
        if bad:
            raise ClusterConfigError(f"compression policies must be Compression objects; {bad[:3]} are not")
        self.policies.update(policies)

    def encode_all(self, grads: Mapping[str, torch.Tensor], step: int
                   ) -> tuple[dict[str, torch.Tensor | Encoded], dict[str, torch.Tensor]]:
        """({name: tensor or Encoded} to send, {name: residual to commit once applied}); see `encode`."""
        if not self.policies:
            return dict(grads), {}
        sent, left = {}, {}
        for name, grad in grads.items():
            policy = self.policies.get(name)
            if policy is None:
                sent[name] = grad
                continue
            buffer = self._cast_buffers.pop(name, None)
            if buffer is not None and sys.getrefcount(buffer) > _ONLY_HERE:  # a push not over still sends it
                buffer = None
            sent[name], residual = encode(policy, name, grad, step, self.residuals.get(name), buffer)
            if isinstance(sent[name], Encoded) and policy.kind in _CASTS and sent[name].payload.device == grad.device:
                self._cast_buffers[name] = sent[name].payload  # written again by a later push of this name
            if residual is not None:
                left[name] = residual
        return sent, left

    def commit(self, left: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Keeps the residuals of `names` from encode_all's `left`: their shard applied them."""
        for name in names:
            if name in left:
                self.residuals.set(name, left[name])

    def pull_casts(self, targets: Mapping[str, torch.Tensor], step: int) -> list[int]:
        """PullRequest.cast for these targets, in order: [] when none is cast."""
        casts = []
        for name, target in targets.items():
            policy = self.policies.get(name)
            cast = ps_pb2.DTYPE_UNSPECIFIED
            if (policy is not None and policy.pull != "none" and target.dtype in (torch.float32, torch.float64)
                    and policy.applies(target.numel() * target.element_size(), step)):
                cast = codec.wire_dtype(_CASTS[policy.pull])
            casts.append(cast)
        return casts if any(casts) else []


# -- the shard's side ------------------------------------------------------------------------------


def check_gradient_meta(name: str, meta: ps_pb2.TensorMeta, variable: ps_pb2.TensorMeta) -> None:
    """TensorMismatchError unless a gradient with `meta` fits a variable with meta `variable`: the same shape,
    and its dtype or, for a FLOAT32 or FLOAT64 variable, FLOAT16 or BFLOAT16 (any encoding)."""
    if list(meta.shape) != list(variable.shape) or not (
            meta.dtype == variable.dtype or (variable.dtype in _WIDE and meta.dtype in _NARROW)):
        hint = " (float16 and bfloat16 gradients are for float32 and float64 variables only)" \
            if meta.dtype in _NARROW and list(meta.shape) == list(variable.shape) else ""
        raise TensorMismatchError(f"gradient for {name!r} is {codec.describe_meta(meta)} but the variable is "
                                  f"{codec.describe_meta(variable)}{hint}")


def _view(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`raw` (uint8) as `dtype`, copied only if it does not start at a multiple of the itemsize."""
    if not raw.size:  # numpy gives empty arrays a zero stride, which torch cannot view as another dtype
        return torch.empty(0, dtype=dtype)
    if raw.ctypes.data % dtype.itemsize:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype)


def sparse_parts(what: str, meta: ps_pb2.TensorMeta, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of a SPARSE or DELTA tensor's bytes (len(raw) checked by codec.meta_nbytes), viewing
    `raw` where aligned. InvalidArgumentError (naming `what`) for indices out of range or not strictly
    increasing."""
    numel = math.prod(meta.shape)
    split = meta.nnz * index_dtype(numel).itemsize
    index = _view(raw[:split], index_dtype(numel))
    if len(index):
        first, last = int(index[0]), int(index[-1])
        if first < 0 or last >= numel:
            raise InvalidArgumentError(f"{what}: {ps_pb2.Encoding.Name(meta.encoding)} index "
                                       f"{first if first < 0 else last} is out of range for {numel} elements")
        if len(index) > 1 and not bool((index[1:] > index[:-1]).all()):
            raise InvalidArgumentError(f"{what}: {ps_pb2.Encoding.Name(meta.encoding)} indices must be strictly "
                                       f"increasing")
    return index, _view(raw[split:], codec.torch_dtype(meta.dtype))


def _new_bytes(nbytes: int) -> np.ndarray:
    """Fresh memory: numpy asks the kernel for huge pages for a large block (a page fault per 2 MiB)."""
    return np.empty(nbytes, dtype=np.uint8)


def decode(name: str, meta: ps_pb2.TensorMeta, raw: np.ndarray, variable: ps_pb2.TensorMeta,
           allocate: Callable[[int], np.ndarray] = _new_bytes) -> torch.Tensor:
    """A gradient's bytes (meta checked by check_gradient_meta, len(raw) by codec.meta_nbytes) as a dense tensor
    of the variable's dtype. InvalidArgumentError for SPARSE indices out of range or not strictly increasing.
    NaN and Inf are left to the caller (the shard's store rejects them unless --allow-nonfinite). A SPARSE
    gradient's dense tensor carries its indices as the attribute SUPPORT_ATTRIBUTE (int64), so a shard
    recording what changed (delta pulls, ps_server/deltas.py) need not search the zeros for them."""
    dtype = codec.torch_dtype(variable.dtype)
    if meta.encoding == ps_pb2.DENSE:
        tensor = codec.dense_tensor(meta, raw)
        return tensor if tensor.dtype == dtype else _widened(tensor, dtype, allocate)
    index, values = sparse_parts(f"gradient for {name!r}", meta, raw)
    numel = math.prod(variable.shape)
    dense = torch.from_numpy(allocate(numel * dtype.itemsize)).view(dtype).zero_()
    index = index.long()
    dense[index] = values.to(dtype)
    dense = dense.reshape(tuple(variable.shape))
    setattr(dense, SUPPORT_ATTRIBUTE, index)
    return dense


def _widened(tensor: torch.Tensor, dtype: torch.dtype, allocate: Callable[[int], np.ndarray]) -> torch.Tensor:
    """`tensor` converted to `dtype`, in memory from `allocate(nbytes)`."""
    out = torch.from_numpy(allocate(tensor.numel() * dtype.itemsize)).view(dtype).view(tensor.shape)
    return out.copy_(tensor)


def pull_dtype(name: str, variable: ps_pb2.TensorMeta, cast: int) -> torch.dtype | None:
    """The dtype to send a variable as for PullRequest.cast `cast` (None: as stored); TensorMismatchError for a
    cast other than FLOAT16 or BFLOAT16 of a FLOAT32 or FLOAT64 variable."""
    if cast == ps_pb2.DTYPE_UNSPECIFIED:
        return None
    if cast not in _NARROW or variable.dtype not in _WIDE:
        shown = ps_pb2.DType.Name(cast) if cast in ps_pb2.DType.values() else f"dtype#{cast}"
        raise TensorMismatchError(f"cannot pull {name!r} ({codec.describe_meta(variable)}) cast to {shown}: casts are "
                                  f"FLOAT16 or BFLOAT16, of float32 and float64 variables only")
    return codec.torch_dtype(cast)


def cast_bytes(raw: memoryview, dtype: torch.dtype, to: torch.dtype) -> memoryview:
    """The bytes of whole `dtype` elements (a chunk of a cast pull) converted to `to`, in new memory."""
    return codec.tensor_bytes(torch.frombuffer(raw, dtype=dtype).to(to))
