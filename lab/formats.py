"""The lab's block formats in NumPy, byte for byte what kernels_cpp/quant.cpp produces.

8-bit weights: blocks of 32, d = max|w|/127 stored as fp16, q = round(w/d) half away
from zero. 4-bit weights: d = (value of largest magnitude, sign kept)/-8 as fp16,
q = clamp(floor(w/d + 8.5), 0, 15), low nibbles hold weights 0-15, high nibbles 16-31.
8-bit activations: like 8-bit weights, plus each block's sum, but the scale is a power of two
2^e, the smallest with max|x| <= 127 * 2^e (e at least ACT_EXP_MIN), kept in fp32.
A quantized tensor is stored split: its fp16 scales region, then its bytes region.
The rules and the tile layout are explained in docs/science.md §2.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32
# Activation scales' exponents (kernels_cpp/lab.h; tests/test_formats.py holds the two equal).
ACT_EXP_MIN, ACT_EXP_MAX = -100, 112
ACT_MAX = np.float32(127 * 2.0 ** ACT_EXP_MAX)
FORMATS = ("f32", "q8", "q4")
BYTES_PER_BLOCK = {"q8": 32, "q4": 16}
ALIGN = 64


class QuantizationError(ValueError):
    """The values cannot be put in a block format (NaN/inf, or a scale past fp16's range)."""


def aligned_empty(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def _blocks(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.size % QK:
        raise ValueError(f"{name} has {x.size} values: block formats need a multiple of {QK}")
    xb = x.reshape(-1, QK)
    bad = ~np.isfinite(xb)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise QuantizationError(f"{name} has a non-finite value ({xb.flat[i]}) at flat index {i}: "
                                f"NaN and inf cannot be quantized; check what produced them")
    return xb


def _fp16_scales(s: np.ndarray, name: str, limit: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = s.astype(np.float16)
    over = ~np.isfinite(h)
    if over.any():
        b = int(np.flatnonzero(over)[0])
        raise QuantizationError(f"{name}: block {b} needs scale {s[b]:.6g}, past fp16's range "
                                f"({limit}); rescale the tensor or keep it in f32")
    return h.view(np.uint16)


def round_away(v: np.ndarray) -> np.ndarray:
    """Round half away from zero in float32, as C's roundf (np.round rounds half to even)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0)).astype(np.float32)


def quantize_q8(x, name: str = "x") -> tuple[np.ndarray, np.ndarray]:
    """-> (fp16 scales as uint16 [nb], int8 [nb, 32])."""
    xb = _blocks(x, name)
    s = np.abs(xb).max(axis=1) / np.float32(127)
    d = _fp16_scales(s, name, "max |w| above 8.3e6")
    with np.errstate(divide="ignore", invalid="ignore"):
        q = round_away(xb / s[:, None])
    q = np.where(s[:, None] == 0, 0, np.clip(q, -127, 127))
    return d, q.astype(np.int8)


def quantize_q4(x, name: str = "x") -> tuple[np.ndarray, np.ndarray]:
    """-> (fp16 scales as uint16 [nb], packed nibbles uint8 [nb, 16])."""
    xb = _blocks(x, name)
    a = np.abs(xb)
    i = np.argmax(a, axis=1)                      # first value of largest magnitude
    m = xb[np.arange(len(xb)), i]
    m = np.where(a.max(axis=1) == 0, np.float32(0), m)  # an all-zero block keeps +0
    s = (m / np.float32(-8)).astype(np.float32)
    d = _fp16_scales(s, name, "max |w| above 5.2e5")
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.floor(xb / s[:, None] + np.float32(8.5))
    q = np.where(s[:, None] == 0, 8, np.clip(v, 0, 15)).astype(np.uint8)
    return d, (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def act_scales(amax: np.ndarray) -> np.ndarray:
    """The power-of-two scale of each activation block from its largest magnitude (0 for 0)."""
    amax = amax.astype(np.float32)
    _, ex = np.frexp(amax)                               # amax = m * 2^ex, 0.5 <= m < 1
    e = np.where(np.ldexp(amax, 7 - ex) <= 127, ex - 7, ex - 6)
    s = np.ldexp(np.float32(1), np.maximum(e, ACT_EXP_MIN)).astype(np.float32)
    return np.where(amax == 0, np.float32(0), s)


def quantize_acts(x, name: str = "x") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """8-bit activation blocks of x [k, cols] -> (int8 [k, nb, 32], fp32 [k, nb], int32 sums [k, nb])."""
    x = np.asarray(x)
    k = x.shape[0] if x.ndim == 2 else 1
    xb = _blocks(x, name)
    big = np.abs(xb) > ACT_MAX
    if big.any():
        i = int(np.flatnonzero(big)[0])
        raise QuantizationError(f"{name} has {xb.flat[i]} at flat index {i}, past the activations' "
                                f"largest scale (127 * 2^{ACT_EXP_MAX}); check what produced it")
    s = act_scales(np.abs(xb).max(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = round_away(xb / s[:, None])
    q = np.where(s[:, None] == 0, 0, np.clip(q, -127, 127)).astype(np.int8)
    return q.reshape(k, -1, QK), s.astype(np.float32).reshape(k, -1), q.sum(axis=1, dtype=np.int32).reshape(k, -1)


def fp16_to_f32(d: np.ndarray) -> np.ndarray:
    return d.view(np.float16).astype(np.float32)


def dequantize_q8(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    return (q.reshape(-1, QK).astype(np.float32) * fp16_to_f32(d).reshape(-1, 1)).ravel()


def dequantize_q4(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    q = q.reshape(-1, QK // 2)
    vals = np.concatenate([q & 15, q >> 4], axis=1).astype(np.int32) - 8
    return (vals.astype(np.float32) * fp16_to_f32(d).reshape(-1, 1)).ravel()


@dataclass
class QTensor:
    """A 2-D tensor in a block format, split layout: `d` holds the fp16 scales
    [rows, cols/32] as uint16, `q` the quantized bytes [rows, cols/32 * (16 or 32)]."""
    fmt: str
    shape: tuple[int, int]
    d: np.ndarray
    q: np.ndarray

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.d.nbytes + self.q.nbytes

    def dequantize(self) -> np.ndarray:
        f = dequantize_q4 if self.fmt == "q4" else dequantize_q8
        return f(self.d, self.q.view(np.int8) if self.fmt == "q8" else self.q).reshape(self.shape)

    def regions(self) -> tuple[bytes, bytes]:
        """The two regions as stored in a weights file: scales, then bytes."""
        return self.d.tobytes(), self.q.tobytes()


def quantize(x: np.ndarray, fmt: str, name: str = "x") -> QTensor:
    """Quantize a float32 matrix [rows, cols] (cols a multiple of 32) to q8 or q4."""
    if fmt not in BYTES_PER_BLOCK:
        raise ValueError(f"fmt={fmt!r}: quantized formats are {', '.join(BYTES_PER_BLOCK)}")
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {x.shape}")
    if x.shape[1] % QK:
        raise ValueError(f"{name} has {x.shape[1]} columns: block formats need a multiple of {QK}")
    d, q = (quantize_q4 if fmt == "q4" else quantize_q8)(x, name)
    rows, nb = x.shape[0], x.shape[1] // QK
    return QTensor(fmt, tuple(x.shape), aligned_copy(d.reshape(rows, nb)),
                   aligned_copy(q.view(np.uint8).reshape(rows, nb * BYTES_PER_BLOCK[fmt])))


# ----------------------------------------------------------------------------
# The kernels' tile layout (kernels_cpp/lab.h, PackedMat): 16 rows per tile
# ----------------------------------------------------------------------------

TILE = 16
PAIR_SCALES = 2 * TILE * 2      # a pair of blocks' fp16 scales: one cache line


def packed_nbytes(fmt: str, shape: tuple[int, int]) -> int:
    """The packed region's size (pack_tiles): per tile a line of scales for each pair of
    blocks, an odd last block's line to itself, and the blocks' bytes."""
    tiles, nb = -(-shape[0] // TILE), shape[1] // QK
    return tiles * (-(-nb // 2) * PAIR_SCALES + nb * BYTES_PER_BLOCK[fmt] * TILE)


def pack_tiles(W: QTensor) -> np.ndarray:
    """Split layout -> the packed region, uint8, byte for byte what the C++ Packed holds: per
    tile of 16 rows, its blocks in pairs, each a line of scales [2 blocks][16 rows] fp16 then
    the two blocks' bytes [chunk][16 rows][4 bytes]; rows padded with scale 0 and the zero
    byte, q8 bytes stored + 128, and the second half of an odd last block's line zero."""
    rows, nb = W.d.shape
    tiles, pairs, bpb = -(-rows // TILE), -(-nb // 2), BYTES_PER_BLOCK[W.fmt]
    flip = 0x80 if W.fmt == "q8" else 0
    d = np.zeros((tiles * TILE, 2 * pairs), "<u2")
    d[:rows, :nb] = W.d
    q = np.full((tiles * TILE, 2 * pairs, bpb), flip, np.uint8)
    q[:rows, :nb] = W.q.reshape(rows, nb, bpb) ^ flip
    d = d.reshape(tiles, TILE, pairs, 2).transpose(0, 2, 3, 1)                   # [tile][pair][block][row]
    q = q.reshape(tiles, TILE, pairs, 2, bpb // 4, 4).transpose(0, 2, 3, 4, 1, 5)  # ... [chunk][row][4]
    out = np.concatenate([d.reshape(tiles, pairs, -1).view(np.uint8), q.reshape(tiles, pairs, -1)], axis=2)
    return np.ascontiguousarray(out.reshape(tiles, -1)[:, :packed_nbytes(W.fmt, (TILE, nb * QK))]).reshape(-1)


def unpack_tiles(fmt: str, shape: tuple[int, int], region: np.ndarray) -> QTensor:
    """The inverse of pack_tiles."""
    rows, cols = shape
    nb, bpb = cols // QK, BYTES_PER_BLOCK[fmt]
    tiles, pairs = -(-rows // TILE), -(-nb // 2)
    t = np.zeros((tiles, pairs, PAIR_SCALES + 2 * TILE * bpb), np.uint8)      # an odd tile's missing block: zeros
    t.reshape(tiles, -1)[:, :packed_nbytes(fmt, (TILE, cols))] = np.asarray(region, np.uint8).reshape(tiles, -1)
    d = np.ascontiguousarray(t[:, :, :PAIR_SCALES]).view("<u2").reshape(tiles, pairs, 2, TILE)
    d = d.transpose(0, 3, 1, 2).reshape(tiles * TILE, 2 * pairs)[:rows, :nb]
    q = t[:, :, PAIR_SCALES:].reshape(tiles, pairs, 2, bpb // 4, TILE, 4).transpose(0, 4, 1, 2, 3, 5)
    q = q.reshape(tiles * TILE, 2 * pairs, bpb)[:rows, :nb] ^ (0x80 if fmt == "q8" else 0)
    return QTensor(fmt, (rows, cols), aligned_copy(d.astype(np.uint16)), aligned_copy(q.reshape(rows, -1)))
