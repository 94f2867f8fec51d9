"""torch's element types as its flight recorder names them (c10::ScalarType's names), declared
once: the name people write for each, and its bytes per element.

The flight recorder reader sizes a collective's tensors with ``dtype_bytes``; the verdict
writes a call as people read it with ``dtype_name``. Pure, imports nothing.
"""

from __future__ import annotations

# c10::ScalarType name -> (torch's name, bytes per element)
SCALAR_TYPES: dict[str, tuple[str, int]] = {
    "Bool": ("bool", 1), "Byte": ("uint8", 1), "Char": ("int8", 1),
    "QInt8": ("qint8", 1), "QUInt8": ("quint8", 1), "QUInt4x2": ("quint4x2", 1), "QUInt2x4": ("quint2x4", 1),
    "Float8_e5m2": ("float8_e5m2", 1), "Float8_e4m3fn": ("float8_e4m3fn", 1),
    "Float8_e5m2fnuz": ("float8_e5m2fnuz", 1), "Float8_e4m3fnuz": ("float8_e4m3fnuz", 1),
    "Float8_e8m0fnu": ("float8_e8m0fnu", 1),
    "Short": ("int16", 2), "Half": ("float16", 2), "BFloat16": ("bfloat16", 2), "UInt16": ("uint16", 2),
    "ComplexHalf": ("complex32", 4),
    "Int": ("int32", 4), "Float": ("float32", 4), "QInt32": ("qint32", 4), "UInt32": ("uint32", 4),
    "Long": ("int64", 8), "Double": ("float64", 8), "ComplexFloat": ("complex64", 8), "UInt64": ("uint64", 8),
    "ComplexDouble": ("complex128", 16),
}


def dtype_name(scalar_type: str) -> str:
    """'Float' -> 'float32'; a name this table lacks, lower-cased."""
    known = SCALAR_TYPES.get(scalar_type)
    return known[0] if known is not None else scalar_type.lower()


def dtype_bytes(scalar_type: str) -> int | None:
    """'Float' -> 4; None for a name this table lacks."""
    known = SCALAR_TYPES.get(scalar_type)
    return known[1] if known is not None else None


__all__ = ["SCALAR_TYPES", "dtype_bytes", "dtype_name"]
