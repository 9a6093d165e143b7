//! Packed numeric arrays: the wire form of token ids, log-probs and sampling masks.
//!
//! A RolloutGroup is mostly per-token numbers. Encoded as MessagePack arrays, every element
//! costs a marker byte and a branch on decode; encoded as one `bin` of little-endian values,
//! an array is one length prefix and one copy. `cargo bench --bench codec` measures both
//! (BENCHMARKS.md has the figures); the `bin` form wins by an order of magnitude and stays
//! readable anywhere: Python reads it with `numpy.frombuffer(b, "<u4")` or
//! `array.array("I", b)`.
//!
//! Decoding also accepts a plain MessagePack array of numbers, so a hand-written producer
//! in another language may send lists; encoding always writes `bin`.

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::marker::PhantomData;

/// A scalar that travels as fixed-width little-endian bytes.
pub trait Packable: bytemuck::Pod + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// Bytes per element on the wire.
    const WIDTH: usize;
    /// Name used in error messages and schemas (`u32le`, `f32le`).
    const DTYPE: &'static str;
    fn write_le(self, out: &mut Vec<u8>);
    fn read_le(bytes: &[u8]) -> Self;
    fn from_u64(v: u64) -> Option<Self>;
    fn from_i64(v: i64) -> Option<Self>;
    fn from_f64(v: f64) -> Option<Self>;
}

impl Packable for u32 {
    const WIDTH: usize = 4;
    const DTYPE: &'static str = "u32le";
    #[inline]
    fn write_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    #[inline]
    fn read_le(bytes: &[u8]) -> Self {
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
    fn from_u64(v: u64) -> Option<Self> {
        u32::try_from(v).ok()
    }
    fn from_i64(v: i64) -> Option<Self> {
        u32::try_from(v).ok()
    }
    fn from_f64(_: f64) -> Option<Self> {
        None
    }
}

impl Packable for f32 {
    const WIDTH: usize = 4;
    const DTYPE: &'static str = "f32le";
    #[inline]
    fn write_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    #[inline]
    fn read_le(bytes: &[u8]) -> Self {
        f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
    fn from_u64(v: u64) -> Option<Self> {
        Some(v as f32)
    }
    fn from_i64(v: i64) -> Option<Self> {
        Some(v as f32)
    }
    fn from_f64(v: f64) -> Option<Self> {
        Some(v as f32)
    }
}

/// A vector of `T` encoded as one MessagePack `bin` of little-endian values.
#[derive(Clone, PartialEq, Default)]
pub struct Packed<T>(pub Vec<T>);

/// Token ids (`u32le`).
pub type Tokens = Packed<u32>;
/// Per-token log-probabilities or rewards (`f32le`).
pub type Floats = Packed<f32>;

impl<T> Packed<T> {
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn as_slice(&self) -> &[T] {
        &self.0
    }
}

impl<T> From<Vec<T>> for Packed<T> {
    fn from(v: Vec<T>) -> Self {
        Packed(v)
    }
}

impl<T> std::ops::Deref for Packed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T: fmt::Debug> fmt::Debug for Packed<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Packable> Serialize for Packed<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if cfg!(target_endian = "little") {
            // The in-memory layout is the wire layout: no copy.
            return serializer.serialize_bytes(bytemuck::cast_slice(&self.0));
        }
        let mut buf = Vec::with_capacity(self.0.len() * T::WIDTH);
        for &v in &self.0 {
            v.write_le(&mut buf);
        }
        serializer.serialize_bytes(&buf)
    }
}

impl<'de, T: Packable> Deserialize<'de> for Packed<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PackedVisitor(PhantomData))
    }
}

struct PackedVisitor<T>(PhantomData<T>);

impl<'de, T: Packable> Visitor<'de> for PackedVisitor<T> {
    type Value = Packed<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a bin of {} values or an array of numbers", T::DTYPE)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        if !v.len().is_multiple_of(T::WIDTH) {
            return Err(E::custom(format_args!(
                "bin of {} bytes is not a whole number of {} values",
                v.len(),
                T::DTYPE
            )));
        }
        if cfg!(target_endian = "little") {
            let mut out = vec![T::zeroed(); v.len() / T::WIDTH];
            bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(v);
            return Ok(Packed(out));
        }
        Ok(Packed(v.chunks_exact(T::WIDTH).map(T::read_le).collect()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(n) = seq.next_element::<Number>()? {
            let v = match n {
                Number::U(u) => T::from_u64(u),
                Number::I(i) => T::from_i64(i),
                Number::F(f) => T::from_f64(f),
            };
            out.push(v.ok_or_else(|| {
                de::Error::custom(format_args!("array element out of range for {}", T::DTYPE))
            })?);
        }
        Ok(Packed(out))
    }
}

/// One element of the list form.
enum Number {
    U(u64),
    I(i64),
    F(f64),
}

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NumberVisitor;
        impl Visitor<'_> for NumberVisitor {
            type Value = Number;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Number, E> {
                Ok(Number::U(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Number, E> {
                Ok(Number::I(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Number, E> {
                Ok(Number::F(v))
            }
        }
        d.deserialize_any(NumberVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bin_round_trip_is_little_endian() {
        let t: Tokens = vec![1, 256, u32::MAX].into();
        let bytes = rmp_serde::to_vec(&t).unwrap();
        // bin8 marker, length 12, then the values little-endian.
        assert_eq!(&bytes[..2], &[0xc4, 12]);
        assert_eq!(&bytes[2..6], &[1, 0, 0, 0]);
        assert_eq!(&bytes[6..10], &[0, 1, 0, 0]);
        let back: Tokens = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn list_form_is_accepted() {
        let bytes = rmp_serde::to_vec(&vec![-0.5f64, -1.0]).unwrap();
        let back: Floats = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back.0, vec![-0.5, -1.0]);
        let bytes = rmp_serde::to_vec(&vec![-1i64]).unwrap();
        assert!(rmp_serde::from_slice::<Tokens>(&bytes).is_err());
    }

    #[test]
    fn ragged_bin_is_an_error() {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &rmpv::Value::Binary(vec![1, 2, 3])).unwrap();
        let err = rmp_serde::from_slice::<Tokens>(&bytes).unwrap_err();
        assert!(err.to_string().contains("not a whole number"), "{err}");
    }
}
