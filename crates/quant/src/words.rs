//! [`Words`]: the elements of a dense weight, either in a vector of their own or in bytes someone else owns (the
//! buffer a streamed spine layer was read into), so that a weight read from disk is used where it landed instead
//! of being copied into a second buffer of the same size.

use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

/// Bytes kept alive for as long as some weight uses them (a read buffer, or any owner of a byte slice).
pub type SharedBytes = Arc<dyn Deref<Target = [u8]> + Send + Sync>;

/// Element types that may be viewed in place in little-endian bytes: every bit pattern is a valid value and
/// the in-memory layout is the stored one on little-endian machines.
pub trait Element: Copy + Send + Sync + 'static {}
impl Element for u16 {}
impl Element for i8 {}
impl Element for f32 {}

/// A weight's elements: owned, or viewed in place in [`SharedBytes`].
pub struct Words<T: Element> {
    store: Store<T>,
}

enum Store<T> {
    Owned(Vec<T>),
    /// `len` elements starting at byte `start` of `owner`, checked aligned and in range at construction.
    Shared {
        owner: SharedBytes,
        start: usize,
        len: usize,
        _t: PhantomData<T>,
    },
}

impl<T: Element> Words<T> {
    /// The elements stored little-endian in `owner[start..]`, viewed in place; `None` when they are not aligned
    /// for `T`, do not fit, or this machine is big-endian (the caller then copies them).
    pub fn in_place(owner: SharedBytes, start: usize, len: usize) -> Option<Self> {
        let size = std::mem::size_of::<T>();
        let bytes: &[u8] = &owner;
        let end = len.checked_mul(size)?.checked_add(start)?;
        if cfg!(target_endian = "big") || end > bytes.len() {
            return None;
        }
        let ptr = bytes[start..].as_ptr();
        if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return None;
        }
        Some(Self {
            store: Store::Shared {
                owner,
                start,
                len,
                _t: PhantomData,
            },
        })
    }

    /// Whether the elements live in someone else's bytes.
    pub fn is_shared(&self) -> bool {
        matches!(self.store, Store::Shared { .. })
    }
}

impl<T: Element> From<Vec<T>> for Words<T> {
    fn from(v: Vec<T>) -> Self {
        Self {
            store: Store::Owned(v),
        }
    }
}

impl<T: Element> Deref for Words<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.store {
            Store::Owned(v) => v,
            Store::Shared {
                owner, start, len, ..
            } => {
                let bytes: &[u8] = owner;
                // SAFETY: `in_place` checked that `len` elements of `T` starting at `start` lie inside the owner's
                // bytes and that the start is aligned for `T`; `Element` types accept every bit pattern; the owner
                // is immutable and kept alive by `self`.
                unsafe { std::slice::from_raw_parts(bytes[*start..].as_ptr().cast::<T>(), *len) }
            }
        }
    }
}

impl<T: Element> Clone for Words<T> {
    fn clone(&self) -> Self {
        match &self.store {
            Store::Owned(v) => v.clone().into(),
            Store::Shared {
                owner, start, len, ..
            } => Self {
                store: Store::Shared {
                    owner: Arc::clone(owner),
                    start: *start,
                    len: *len,
                    _t: PhantomData,
                },
            },
        }
    }
}

impl<T: Element + PartialEq> PartialEq for Words<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Element> std::fmt::Debug for Words<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Words({} {}, {})",
            self.len(),
            std::any::type_name::<T>(),
            if self.is_shared() {
                "in place"
            } else {
                "owned"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes on an 8-byte boundary, so that alignment is known.
    struct Aligned(Vec<u64>);

    impl Deref for Aligned {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            // SAFETY: the vector's elements are plain bytes when viewed as u8, and the slice covers exactly them.
            unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 8) }
        }
    }

    #[test]
    fn views_aligned_bytes_in_place() {
        let owner: SharedBytes = Arc::new(Aligned(vec![
            u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]),
            u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]),
        ]));
        let w = Words::<u16>::in_place(Arc::clone(&owner), 2, 3).expect("aligned");
        assert!(w.is_shared());
        assert_eq!(&*w, &[0x0302, 0x0504, 0x0706]);
        assert_eq!(w.clone(), Words::from(vec![0x0302u16, 0x0504, 0x0706]));
        assert!(w.clone().is_shared(), "a clone shares the bytes");
        // Out of range or misaligned: the caller copies.
        assert!(Words::<u16>::in_place(Arc::clone(&owner), 2, 8).is_none());
        assert!(Words::<u16>::in_place(Arc::clone(&owner), 1, 2).is_none());
        assert!(Words::<f32>::in_place(Arc::clone(&owner), 2, 1).is_none());
        let f = Words::<f32>::in_place(owner, 4, 3).expect("aligned");
        assert_eq!(f[0], f32::from_le_bytes([4, 5, 6, 7]));
        assert_eq!(Words::<i8>::from(vec![-1i8, 2]).len(), 2);
    }
}
