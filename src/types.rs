//! Data types and reduction operations, numbered as in NCCL.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

mod fp8;
pub use fp8::{F8E4M3, F8E5M2};

/// Element type of a collective's buffers. Discriminants equal NCCL's `ncclDataType_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// Signed 8-bit integer.
    I8 = 0,
    /// Unsigned 8-bit integer.
    U8 = 1,
    /// Signed 32-bit integer.
    I32 = 2,
    /// Unsigned 32-bit integer.
    U32 = 3,
    /// Signed 64-bit integer.
    I64 = 4,
    /// Unsigned 64-bit integer.
    U64 = 5,
    /// IEEE 754 binary16.
    F16 = 6,
    /// IEEE 754 binary32.
    F32 = 7,
    /// IEEE 754 binary64.
    F64 = 8,
    /// bfloat16 (the upper half of a binary32).
    Bf16 = 9,
    /// OCP 8-bit float E4M3 (`e4m3fn`, NCCL's `ncclFloat8e4m3`): see [`F8E4M3`].
    F8E4M3 = 10,
    /// OCP 8-bit float E5M2 (NCCL's `ncclFloat8e5m2`): see [`F8E5M2`].
    F8E5M2 = 11,
}

impl DataType {
    /// Every data type, in NCCL order.
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// Short name as used on the command line (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::Bf16 => "bf16",
            DataType::F8E4M3 => "f8e4m3",
            DataType::F8E5M2 => "f8e5m2",
        }
    }

    /// True for floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16
                | DataType::F32
                | DataType::F64
                | DataType::Bf16
                | DataType::F8E4M3
                | DataType::F8E5M2
        )
    }

    /// The data type with NCCL's numeric value `v`.
    pub fn from_nccl(v: i32) -> Option<DataType> {
        DataType::ALL.iter().copied().find(|d| *d as i32 == v)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let l = s.to_ascii_lowercase();
        let alias = match l.as_str() {
            "int8" | "char" => "i8",
            "uint8" => "u8",
            "int32" | "int" => "i32",
            "uint32" => "u32",
            "int64" => "i64",
            "uint64" => "u64",
            "float16" | "half" => "f16",
            "float32" | "float" => "f32",
            "float64" | "double" => "f64",
            "bfloat16" => "bf16",
            "float8e4m3" | "fp8e4m3" | "e4m3" => "f8e4m3",
            "float8e5m2" | "fp8e5m2" | "e5m2" => "f8e5m2",
            other => other,
        };
        DataType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == alias)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown data type '{s}': expected one of i8 u8 i32 u32 i64 u64 f16 bf16 f32 f64 f8e4m3 f8e5m2"
                ))
            })
    }
}

/// Reduction operation. Discriminants equal NCCL's `ncclRedOp_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RedOp {
    /// Sum (integers wrap on overflow).
    Sum = 0,
    /// Product (integers wrap on overflow).
    Prod = 1,
    /// Maximum.
    Max = 2,
    /// Minimum.
    Min = 3,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg = 4,
}

impl RedOp {
    /// Every operation, in NCCL order.
    pub const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg];

    /// Short name (`sum`, `prod`, `max`, `min`, `avg`).
    pub const fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Max => "max",
            RedOp::Min => "min",
            RedOp::Avg => "avg",
        }
    }

    /// The operation with NCCL's numeric value `v`.
    pub fn from_nccl(v: i32) -> Option<RedOp> {
        RedOp::ALL.iter().copied().find(|o| *o as i32 == v)
    }
}

impl fmt::Display for RedOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RedOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let l = s.to_ascii_lowercase();
        RedOp::ALL
            .iter()
            .copied()
            .find(|o| o.name() == l)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown reduction '{s}': expected one of sum prod max min avg"
                ))
            })
    }
}

/// A Rust element type that maps to a [`DataType`].
///
/// Implemented for `i8 u8 i32 u32 i64 u64 f32 f64`, `half::f16`, `half::bf16`, [`F8E4M3`]
/// and [`F8E5M2`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching data type.
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DataType = DataType::$d; })* };
}
element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
    f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => Bf16, F8E4M3 => F8E4M3,
    F8E5M2 => F8E5M2);

/// Bytes in words, rounded down to the unit: `512 B`, `48 KiB`, `4 MiB`, `2 GiB`; a size
/// between units keeps one decimal (`1.5 MiB`).
pub fn human_bytes(b: usize) -> String {
    let units = [(30, "GiB"), (20, "MiB"), (10, "KiB")];
    for (shift, unit) in units {
        if b >= 1 << shift {
            let whole = b >> shift;
            return if b % (1 << shift) == 0 || whole >= 100 {
                format!("{whole} {unit}")
            } else {
                format!("{:.1} {unit}", b as f64 / (1u64 << shift) as f64)
            };
        }
    }
    format!("{b} B")
}
