"""Wire format: safetensors bytes with a string metadata header.

Every payload (push body, fragment or params download) is one safetensors blob. Its metadata (a
str -> str map, as safetensors allows) carries the protocol fields; see docs/protocol.md.

Push tensors, by scheme:
- none: `<leaf>` float32 with the leaf's shape;
- int8: `q/<leaf>` int8 (flat, padded to whole blocks) and `s/<leaf>` float32 scales;
- int4: `q/<leaf>` uint8 (two values per byte) and `s/<leaf>` float32 scales;
  the leaf shapes are in metadata `shapes` (JSON) for quantized schemes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

from diloco_trainer.config import PER_BYTE, SCHEMES, Scheme
from diloco_trainer.payload import Pieces, safetensors_pieces
from diloco_trainer.quantize import Quantized, dequantize, quantize

FORMAT = "diloco/1"
# The largest counter (step, token count, version, attempt) accepted anywhere on the wire: every
# number up to it is exact in a float64 (Prometheus, JSON readers in other languages), so sums
# and gauges of them never overflow or round to something else.
MAX_COUNTER = 2**53 - 1
_DIGITS = re.compile(r"[0-9]{1,16}")


class WireError(ValueError):
    """A payload that cannot be decoded; the message says what is wrong."""


class PayloadMismatch(WireError):
    """A well-formed payload whose tensors have the wrong dtype (the syncer answers 422)."""


@dataclass(frozen=True)
class PushHeader:
    fragment: int
    base_version: int
    c_steps: int
    c_tokens: int
    scheme: Scheme
    unit: str
    attempt: int
    block_size: int = 0
    quant_error: float | None = None  # relative L2 error the sender measured (quantized only)
    # The learner's step (within its attempt) at the push: with unit and attempt it names one
    # push, so a retry is recognised. 0 from a learner that predates the field.
    step: int = 0


def tensor_pieces(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> Pieces:
    """A payload of `tensors`, unjoined (payload.py): downloads are written from it directly."""
    meta = {"format": FORMAT, **{k: str(v) for k, v in metadata.items()}}
    return safetensors_pieces(tensors, meta)


def encode_tensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    return tensor_pieces(tensors, metadata).joined()


def decode_tensors(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse safetensors bytes into (tensors, metadata), raising WireError on malformed input."""
    if len(payload) < 8:
        raise WireError(f"payload too short ({len(payload)} bytes) for safetensors")
    header_len = int.from_bytes(payload[:8], "little")
    if header_len <= 0 or 8 + header_len > len(payload):
        raise WireError(f"safetensors header length {header_len} exceeds payload")
    try:
        header = loads_json(payload[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError("safetensors header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise WireError(f"payload metadata.format must be {FORMAT!r}")
    try:
        tensors = st_load(payload)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise WireError(f"malformed safetensors payload: {exc}") from exc
    return dict(tensors), {str(k): str(v) for k, v in metadata.items()}


def parse_count(raw: str) -> int | None:
    """A non-negative decimal integer written in ASCII digits only, at most MAX_COUNTER; None for
    anything else (signs, spaces, underscores and non-ASCII digits, which `int` accepts)."""
    if not _DIGITS.fullmatch(raw):
        return None
    value = int(raw)
    return value if value <= MAX_COUNTER else None


def loads_json(data: str | bytes) -> Any:
    """`json.loads`, with what json reports other than JSONDecodeError (RecursionError for deep
    nesting, ValueError for an integer of more than 4300 digits) raised as a JSONDecodeError, so
    a hostile document is a malformed one, not a crash."""
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError) as exc:
        reason = "nesting too deep" if isinstance(exc, RecursionError) else str(exc)[:80]
        raise json.JSONDecodeError(reason, "", 0) from None


def _int_field(meta: Mapping[str, str], key: str, minimum: int = 0) -> int:
    if key not in meta:
        raise WireError(f"payload metadata.{key}: missing")
    value = parse_count(meta[key])
    if value is None:
        raise WireError(
            f"payload metadata.{key}: not an integer in 0..{MAX_COUNTER}: {meta[key][:40]!r}"
        )
    if value < minimum:
        raise WireError(f"payload metadata.{key}: must be >= {minimum}, got {value}")
    return value


def _float_field(meta: Mapping[str, str], key: str) -> float | None:
    """An optional non-negative finite float (None when absent)."""
    if key not in meta:
        return None
    try:
        value = float(meta[key])
    except ValueError as exc:
        raise WireError(f"payload metadata.{key}: not a number: {meta[key]!r}") from exc
    if not math.isfinite(value) or value < 0:
        raise WireError(f"payload metadata.{key}: must be finite and >= 0, got {value}")
    return value


class EncodedPush(NamedTuple):
    body: bytes
    quant_error: float  # relative L2 error of the whole fragment; 0 for `none`
    applied: dict[str, np.ndarray]  # the float32 delta the syncer decodes from `body`


def encode_push(
    header: PushHeader, delta: Mapping[str, np.ndarray], block_size: int = 128
) -> EncodedPush:
    """Encode a fragment delta, quantizing per `header.scheme`."""
    meta: dict[str, str] = {
        "kind": "push",
        "fragment": str(header.fragment),
        "baseVersion": str(header.base_version),
        "cSteps": str(header.c_steps),
        "cTokens": str(header.c_tokens),
        "scheme": header.scheme,
        "unit": header.unit,
        "attempt": str(header.attempt),
        "step": str(header.step),
    }
    if header.scheme == "none":
        tensors = {k: np.asarray(v, dtype=np.float32) for k, v in delta.items()}
        return EncodedPush(encode_tensors(tensors, meta), 0.0, tensors)
    quantized = {
        name: quantize(np.asarray(value, dtype=np.float32), header.scheme, block_size)
        for name, value in delta.items()
    }
    applied = {name: dequantize(qt) for name, qt in quantized.items()}
    err_sq = 0.0
    ref_sq = 0.0
    for name, restored in applied.items():
        arr = np.asarray(delta[name], dtype=np.float32)
        diff = restored.astype(np.float64) - arr
        err_sq += float(np.sum(diff * diff))
        ref_sq += float(np.sum(np.square(arr, dtype=np.float64)))
    tensors = _quantized_tensors(quantized, meta)
    meta["blockSize"] = str(block_size)
    rel = (err_sq**0.5) / (ref_sq**0.5) if ref_sq > 0 else 0.0
    meta["quantError"] = f"{rel:.6g}"
    return EncodedPush(encode_tensors(tensors, meta), rel, applied)


def decode_push(payload: bytes) -> tuple[PushHeader, dict[str, np.ndarray]]:
    """Decode a push body into its header and float32 delta (dequantized)."""
    tensors, meta = decode_tensors(payload)
    if meta.get("kind") != "push":
        raise WireError("payload metadata.kind must be 'push'")
    scheme = meta.get("scheme", "")
    if scheme not in SCHEMES:
        raise WireError(f"payload metadata.scheme: {scheme!r} not one of {', '.join(SCHEMES)}")
    unit = meta.get("unit", "")
    if not unit:
        raise WireError("payload metadata.unit: missing")
    block_size = _int_field(meta, "blockSize", 1) if scheme != "none" else 0
    header = PushHeader(
        fragment=_int_field(meta, "fragment"),
        base_version=_int_field(meta, "baseVersion"),
        c_steps=_int_field(meta, "cSteps"),
        c_tokens=_int_field(meta, "cTokens"),
        scheme=cast(Scheme, scheme),
        unit=unit,
        attempt=_int_field(meta, "attempt"),
        block_size=block_size,
        quant_error=_float_field(meta, "quantError"),
        step=_int_field(meta, "step") if "step" in meta else 0,
    )
    if scheme == "none":
        for name, arr in tensors.items():
            if arr.dtype != np.float32:
                raise PayloadMismatch(f"tensor {name}: dtype {arr.dtype}, expected float32")
        return header, tensors
    return header, _dequantize_all(tensors, meta, header.scheme, header.block_size)


def _quantized_tensors(
    quantized: Mapping[str, Quantized], meta: dict[str, str]
) -> dict[str, np.ndarray]:
    """The `q/<leaf>` and `s/<leaf>` tensors of quantized leaves; records shapes and block size
    in `meta` (one block size per payload)."""
    tensors: dict[str, np.ndarray] = {}
    for name, qt in quantized.items():
        tensors[f"q/{name}"] = qt.data
        tensors[f"s/{name}"] = qt.scales
        meta["blockSize"] = str(qt.block_size)
    meta["shapes"] = json.dumps({n: list(q.shape) for n, q in quantized.items()}, sort_keys=True)
    return tensors


def _dequantize_all(
    tensors: Mapping[str, np.ndarray], meta: Mapping[str, str], scheme: Scheme, block_size: int
) -> dict[str, np.ndarray]:
    try:
        shapes_raw: Any = loads_json(meta.get("shapes", ""))
    except json.JSONDecodeError as exc:
        raise WireError(f"payload metadata.shapes: not JSON: {exc}") from exc
    if not isinstance(shapes_raw, dict):
        raise WireError("payload metadata.shapes: expected a JSON object")
    want_dtype = np.int8 if scheme == "int8" else np.uint8
    expected_keys = {f"{p}/{n}" for n in shapes_raw for p in ("q", "s")}
    if set(tensors) != expected_keys:
        extra = sorted(set(tensors) - expected_keys)
        missing = sorted(expected_keys - set(tensors))
        raise WireError(
            f"quantized tensors do not match metadata.shapes (extra {extra}, missing {missing})"
        )
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes_raw.items():
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WireError(f"payload metadata.shapes.{name}: not a list of sizes")
        data, scales = tensors[f"q/{name}"], tensors[f"s/{name}"]
        if data.dtype != want_dtype or scales.dtype != np.float32:
            raise PayloadMismatch(
                f"tensor {name}: quantized dtypes {data.dtype}/{scales.dtype}, "
                f"expected {np.dtype(want_dtype)}/float32"
            )
        try:
            out[name] = dequantize(
                Quantized(scheme, tuple(shape), block_size, data.ravel(), scales.ravel())
            )
        except ValueError as exc:
            raise WireError(f"tensor {name}: {exc}") from exc
    return out


def params_pieces(
    params: Mapping[str, np.ndarray],
    versions: list[int],
    fragment: int | None = None,
    epoch: str = "",
) -> Pieces:
    """Global parameters (all, or one fragment's) with their version(s), float32 unquantized,
    in pieces that point into `params`. `epoch` names the syncer process that published them
    (see `encode_step`)."""
    meta = {"kind": "params", "versions": json.dumps(versions), "epoch": epoch}
    if fragment is not None:
        meta["fragment"] = str(fragment)
    return tensor_pieces({k: np.asarray(v, dtype=np.float32) for k, v in params.items()}, meta)


@dataclass(frozen=True)
class Download:
    """A decoded fragment or parameters download. `step` True: `tensors` is a dequantized step
    from `from_version` to apply to the receiver's copy (`downlink.apply_step`), not values."""

    tensors: dict[str, np.ndarray]
    versions: list[int]
    fragment: int | None
    epoch: str
    step: bool = False
    from_version: int = -1
    checksum: int = 0  # of the copy a step leads to (downlink.checksum)


def encode_step(
    step: Mapping[str, Quantized],
    fragment: int,
    from_version: int,
    version: int,
    epoch: str,
    checksum: int,
) -> bytes:
    """A fragment's new version as a quantized step from the previous one (downlink.py), with the
    checksum of the copy it leads to."""
    if not step:
        raise ValueError("a step payload needs at least one tensor")
    scheme = next(iter(step.values())).scheme
    meta = {
        "kind": "step",
        "fragment": str(fragment),
        "versions": json.dumps([version]),
        "fromVersion": str(from_version),
        "epoch": epoch,
        "scheme": scheme,
        "checksum": str(checksum),
    }
    return encode_tensors(_quantized_tensors(step, meta), meta)


def decode_download(payload: bytes) -> Download:
    """Decode a `params` payload (float32 values) or a `step` payload (dequantized step)."""
    tensors, meta = decode_tensors(payload)
    kind = meta.get("kind")
    if kind not in ("params", "step"):
        raise WireError("payload metadata.kind must be 'params' or 'step'")
    try:
        versions = loads_json(meta.get("versions", ""))
    except json.JSONDecodeError as exc:
        raise WireError(f"payload metadata.versions: not JSON: {exc}") from exc
    if not isinstance(versions, list) or not all(isinstance(v, int) for v in versions):
        raise WireError("payload metadata.versions: expected a list of integers")
    fragment = _int_field(meta, "fragment") if "fragment" in meta else None
    epoch = meta.get("epoch", "")
    if kind == "params":
        return Download(tensors, versions, fragment, epoch)
    scheme = meta.get("scheme", "")
    if scheme not in PER_BYTE:
        raise WireError(f"payload metadata.scheme: {scheme!r} not one of {', '.join(PER_BYTE)}")
    if fragment is None or len(versions) != 1:
        raise WireError("step payload: needs metadata.fragment and one version")
    block_size = _int_field(meta, "blockSize", 1)
    values = _dequantize_all(tensors, meta, cast(Scheme, scheme), block_size)
    return Download(
        values,
        versions,
        fragment,
        epoch,
        step=True,
        from_version=_int_field(meta, "fromVersion"),
        checksum=_int_field(meta, "checksum"),
    )


def decode_params(payload: bytes) -> Download:
    """Decode a `params` payload (values); a step is refused."""
    got = decode_download(payload)
    if got.step:
        raise WireError("payload metadata.kind must be 'params'")
    return got


# ---------------------------------------------------------------- data leases
# A learner's place in the run's data: header of its pushes, and a JSON object in the join and
# claim replies (docs/protocol.md, "Data leases").
DATA_POSITION_HEADER = "X-Diloco-Data-Position"


@dataclass(frozen=True)
class DataLease:
    """Shard `shard` of the train split in data epoch `epoch`, of which `position` batches are
    consumed."""

    epoch: int
    shard: int
    position: int = 0

    def same_shard(self, other: DataLease | None) -> bool:
        return other is not None and (self.epoch, self.shard) == (other.epoch, other.shard)

    def header(self) -> str:
        return f"{self.epoch}.{self.shard}.{self.position}"

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "position": self.position}


def parse_data_position(raw: str, num_shards: int) -> DataLease:
    """The `X-Diloco-Data-Position` header, `<epoch>.<shard>.<position>` in ASCII digits, shard
    below `num_shards`; WireError naming the header otherwise."""
    parts = raw.split(".")
    values = [parse_count(p) for p in parts] if len(parts) == 3 else [None]
    if any(v is None for v in values):
        raise WireError(
            f"{DATA_POSITION_HEADER}: expected <epoch>.<shard>.<position>, "
            f"integers in 0..{MAX_COUNTER}, got {raw[:60]!r}"
        )
    epoch, shard, position = cast(list[int], values)
    return _checked_lease(epoch, shard, position, num_shards, DATA_POSITION_HEADER)


def data_lease_from_json(data: Any, num_shards: int, where: str) -> DataLease:
    """A lease JSON object `{epoch, shard, position}`; WireError naming `where` otherwise."""
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected an object with epoch, shard, position")
    values = []
    for key in ("epoch", "shard", "position"):
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNTER:
            raise WireError(f"{where}.{key}: expected an integer in 0..{MAX_COUNTER}")
        values.append(value)
    epoch, shard, position = values
    return _checked_lease(epoch, shard, position, num_shards, where)


def _checked_lease(epoch: int, shard: int, position: int, num_shards: int, where: str) -> DataLease:
    if shard >= num_shards:
        raise WireError(f"{where}: shard {shard} outside 0..{num_shards - 1} (data.shards)")
    return DataLease(epoch, shard, position)
