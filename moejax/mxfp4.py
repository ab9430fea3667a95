"""MXFP4 (OCP Microscaling FP4) expert weights as GPT-OSS checkpoints store them.

Format (OCP Microscaling Formats v1.0): each element is FP4 E2M1 -- 1 sign bit,
2 exponent bits (bias 1), 1 mantissa bit; exponent field 0 is subnormal (0 or
0.5), so the magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Two elements share a
byte, the *low* nibble holding the earlier element. A block of 32 elements (16
bytes) shares one E8M0 scale byte ``s``: the scale is ``2 ** (s - 127)``, and
``s == 255`` means NaN.

On disk (Hugging Face, transformers model type ``gpt_oss``) a projection is a
pair ``<proj>_blocks`` uint8 ``[E, R, G, 16]`` and ``<proj>_scales`` uint8
``[E, R, G]``: row ``r`` of expert ``e`` holds the ``G * 32`` input-dimension
weights of output ``r`` (the ``[out, in]`` layout of a linear layer).
transformers' ``GptOssExperts`` multiplies ``x @ W`` with ``[E, in, out]``
parameters, so its loader transposes the last two axes after decoding:

* ``gate_up_proj_blocks`` ``[E, 2*I, H/32, 16]`` -> ``gate_up_proj`` ``[E, H, 2*I]``
* ``down_proj_blocks``    ``[E, H, I/32, 16]``   -> ``down_proj``    ``[E, I, H]``

(gate and up stay interleaved along the ``2*I`` axis: gate at even columns.)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# The 16 E2M1 codes: bit 3 is the sign, so codes 8..15 are the negatives of 0..7.
FP4_E2M1_VALUES: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)

SCALE_BIAS = 127
EXPERT_KINDS = ("gate_up_proj", "down_proj")
_OUT_DTYPES = {name: np.dtype(t) for name, t in (
    ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
    ("float32", np.float32), ("float64", np.float64))}


def _luts(work: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    # Byte -> its two decoded elements (low nibble first): one gather per byte instead
    # of two nibble extractions. Scale byte -> 2**(s-127); every finite E8M0 scale
    # (2**-127 .. 2**127) is exact in float32, and code * scale is exact whenever the
    # product is representable, so multiplying by this table is lossless.
    b = np.arange(256)
    byte_lut = np.stack([FP4_E2M1_VALUES[b & 0xF], FP4_E2M1_VALUES[b >> 4]], -1).astype(work)
    scale_lut = np.ldexp(np.ones(256, work), np.minimum(b, 254) - SCALE_BIAS)
    scale_lut[255] = np.nan  # E8M0 reserves 0xFF for NaN
    return byte_lut, scale_lut


_LUTS = {np.dtype(np.float32): _luts(np.dtype(np.float32)),
         np.dtype(np.float64): _luts(np.dtype(np.float64))}


def _out_dtype(dtype: object, name: str | None) -> np.dtype:
    try:
        dt = _OUT_DTYPES[dtype] if dtype in _OUT_DTYPES else np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{_who(name)}unsupported output dtype {dtype!r}") from e
    if dt not in _OUT_DTYPES.values():
        raise ValueError(f"{_who(name)}output dtype must be one of {sorted(_OUT_DTYPES)}, got {dt}")
    return dt


def _who(name: str | None) -> str:
    return f"{name}: " if name else ""


def _check(blocks: np.ndarray, scales: np.ndarray, name: str | None, rows_per_chunk: int) -> None:
    who = _who(name)
    for what, a in (("blocks", blocks), ("scales", scales)):
        if not isinstance(a, np.ndarray):
            raise ValueError(f"{who}{what} must be a NumPy array, got {type(a).__name__}")
        if a.dtype != np.uint8:
            raise ValueError(f"{who}{what} must be uint8, got {a.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] == 0:
        raise ValueError(f"{who}blocks must be [..., G, B] with B > 0, got shape {blocks.shape}")
    if scales.shape[:-1] != blocks.shape[:-2] or scales.ndim != blocks.ndim - 1:
        raise ValueError(f"{who}leading shapes differ: blocks {blocks.shape} [..., G, B] "
                         f"vs scales {scales.shape} [..., G]")
    if scales.shape[-1] != blocks.shape[-2]:
        raise ValueError(f"{who}scales group axis {scales.shape[-1]} does not match blocks' "
                         f"group axis G={blocks.shape[-2]} (blocks {blocks.shape}, scales {scales.shape})")
    if rows_per_chunk < 1:
        raise ValueError(f"{who}rows_per_chunk must be >= 1, got {rows_per_chunk}")


def _decode(blocks: np.ndarray, scales: np.ndarray, work: np.dtype) -> np.ndarray:
    """uint8 [n, B] + [n] -> ``work`` [n, 2B]; the only full-precision temporary."""
    byte_lut, scale_lut = _LUTS[work]
    vals = byte_lut[blocks]  # [n, B, 2]
    vals *= scale_lut[scales][:, None, None]
    return vals.reshape(blocks.shape[0], -1)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: object = np.float32, *,
                     rows_per_chunk: int = 1 << 16, name: str | None = None) -> np.ndarray:
    """Decode blocks uint8 ``[..., G, B]`` + scales uint8 ``[..., G]`` to ``[..., G*B*2]``.

    ``dtype``: "float32", "bfloat16", "float16", "float64" or a NumPy/ml_dtypes dtype.
    Work happens ``rows_per_chunk`` scale groups at a time (float32, or float64 for a
    float64 output) into a preallocated output, so a bfloat16 result never has a
    float32 twin of the whole tensor. Results past the output dtype's range become inf
    (float32/bfloat16: only with scale bytes 253/254); scale byte 255 decodes to NaN.
    """
    _check(blocks, scales, name, rows_per_chunk)
    dt = _out_dtype(dtype, name)
    work = np.dtype(np.float64 if dt == np.float64 else np.float32)
    *lead, g, b = blocks.shape
    out = np.empty((*lead, g * b * 2), dt)
    flat_b, flat_s = blocks.reshape(-1, b), scales.reshape(-1)  # views for contiguous (mmap) input
    flat_o = out.reshape(-1, 2 * b)
    with np.errstate(over="ignore"):  # overflow to inf is the documented result
        for r0 in range(0, flat_s.shape[0], rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, flat_s.shape[0])
            flat_o[r0:r1] = _decode(flat_b[r0:r1], flat_s[r0:r1], work)
    return out


def dequantize_expert_tensor(kind: str, blocks: np.ndarray, scales: np.ndarray,
                             dtype: object = np.float32, *, rows_per_chunk: int = 1 << 16,
                             name: str | None = None) -> np.ndarray:
    """On-disk ``<kind>_blocks``/``<kind>_scales`` -> transformers' ``GptOssExperts.<kind>``.

    ``kind`` is "gate_up_proj" (blocks ``[E, 2I, H/32, 16]`` -> ``[E, H, 2I]``) or
    "down_proj" (blocks ``[E, H, I/32, 16]`` -> ``[E, I, H]``): both decode to
    ``[E, out, in]`` and are transposed to ``[E, in, out]``. The transpose is written
    chunk by chunk straight into the C-contiguous result (no decoded ``[E, out, in]`` copy).
    """
    name = name or kind
    if kind not in EXPERT_KINDS:
        raise ValueError(f"{name}: kind must be one of {EXPERT_KINDS}, got {kind!r}")
    _check(blocks, scales, name, rows_per_chunk)
    if blocks.ndim != 4:
        raise ValueError(f"{name}: expert blocks must be [E, R, G, B], got shape {blocks.shape}")
    n_exp, n_out, g, b = blocks.shape
    if kind == "gate_up_proj" and n_out % 2:
        raise ValueError(f"{name}: gate_up_proj needs an even row count (2*intermediate), got {n_out}")
    dt = _out_dtype(dtype, name)
    work = np.dtype(np.float64 if dt == np.float64 else np.float32)
    n_in = g * b * 2
    out = np.empty((n_exp, n_in, n_out), dt)
    out_t = out.transpose(0, 2, 1)  # [E, out, in] view of the result
    step = max(1, rows_per_chunk // max(g, 1))  # output rows per chunk
    with np.errstate(over="ignore"):  # overflow to inf is the documented result
        for e in range(n_exp):
            for r0 in range(0, n_out, step):
                r1 = min(r0 + step, n_out)
                rows = _decode(blocks[e, r0:r1].reshape(-1, b), scales[e, r0:r1].reshape(-1), work)
                # Cast before the strided (transposing) copy so it moves target-sized items.
                out_t[e, r0:r1] = rows.reshape(r1 - r0, n_in).astype(dt, copy=False)
    return out


def quantize_mxfp4(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Encode float ``[..., N]`` as (blocks uint8 ``[..., N/block, block/2]``, scales ``[..., N/block]``).

    Per block the scale is the smallest power of two ``2**k`` with ``max|x| <= 6 * 2**k``
    (k clamped to [-127, 127]; all-zero blocks get k = 0), then each ``x / 2**k`` rounds
    to the nearest E2M1 value, ties to the even code (mantissa bit 0), beyond 6 saturating.
    """
    x = np.asarray(x, dtype=np.float64)
    if block < 2 or block % 2:
        raise ValueError(f"block must be an even size >= 2, got {block}")
    if x.ndim < 1 or x.shape[-1] % block:
        raise ValueError(f"last axis must be a multiple of block={block}, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot encode non-finite values in MXFP4")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xb).max(axis=-1)
    # frexp gives amax/6 = m * 2**k with m in [0.5, 1): 2**k covers it, 2**(k-1) only when m == 0.5.
    m, k = np.frexp(amax / 6.0)
    k = np.where(m == 0.5, k - 1, k)
    # amax/6 can round: fix k so that 6 * 2**(k-1) < amax <= 6 * 2**k holds exactly.
    k = np.where(amax > np.ldexp(6.0, k), k + 1, k)
    k = np.where(amax <= np.ldexp(6.0, k - 1), k - 1, k)
    k = np.clip(np.where(amax == 0, 0, k), -SCALE_BIAS, SCALE_BIAS)
    y = np.abs(np.ldexp(xb, -k[..., None]))
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # midpoints between magnitudes
    lo, hi = np.searchsorted(mids, y, "left"), np.searchsorted(mids, y, "right")
    code = np.where(lo != hi, lo + lo % 2, lo)  # on a tie pick the even code
    code = (code | (np.signbit(xb) << 3)).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (k + SCALE_BIAS).astype(np.uint8)

