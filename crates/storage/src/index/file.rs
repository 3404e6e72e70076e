//! The shapes of an index file the engine reads (`weight_map` and `metadata`), deserialised by visitors that
//! stream through the JSON: anything else is skipped unread, and a member of the wrong shape becomes a value the
//! caller reports in its own words instead of a parse error.

use serde::de::{self, Deserialize, Deserializer};
use serde_json::Value;

/// What an index file holds, as far as the engine reads it; anything else in it is skipped unread.
pub(super) enum IndexFile {
    /// The top level is an object: its `weight_map` and `metadata`, when present (the last of repeated keys).
    Object {
        weight_map: Option<Entries>,
        metadata: Option<Value>,
    },
    /// The top level is something else.
    NotObject,
}

/// The `weight_map` member: `(tensor, shard)` pairs in file order, or a note that it is not an object.
pub(super) enum Entries {
    Object(Vec<(String, ShardName)>),
    NotObject,
}

/// One `weight_map` value: a shard file name, or a note that it is not a string.
pub(super) enum ShardName {
    Name(String),
    NotString,
}

/// Implements `visit_*` for every JSON value other than the ones a visitor handles itself, each one consumed and
/// answered with `$other` (a shape the caller reports in its own words).
macro_rules! other_shapes {
    ($other:expr; $($skip:ident)*) => {
        $(other_shapes!(@one $skip, $other);)*
    };
    (@one bool, $other:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one i64, $other:expr) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one u64, $other:expr) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one f64, $other:expr) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one str, $other:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one unit, $other:expr) => {
        fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one seq, $other:expr) => {
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Self::Value, A::Error> {
            while seq.next_element::<de::IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
    (@one map, $other:expr) => {
        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
            while map.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
}

impl<'de> Deserialize<'de> for IndexFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = IndexFile;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a safetensors index")
            }
            fn visit_map<A: de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<IndexFile, A::Error> {
                let (mut weight_map, mut metadata) = (None, None);
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "weight_map" => weight_map = Some(map.next_value()?),
                        "metadata" => metadata = Some(map.next_value()?),
                        _ => {
                            map.next_value::<de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(IndexFile::Object {
                    weight_map,
                    metadata,
                })
            }
            other_shapes!(IndexFile::NotObject; bool i64 u64 f64 str unit seq);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a weight_map")
            }
            fn visit_map<A: de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(entry) = map.next_entry::<String, ShardName>()? {
                    entries.push(entry);
                }
                Ok(Entries::Object(entries))
            }
            other_shapes!(Entries::NotObject; bool i64 u64 f64 str unit seq);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for ShardName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = ShardName;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a shard file name")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<ShardName, E> {
                Ok(ShardName::Name(s.to_string()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> std::result::Result<ShardName, E> {
                Ok(ShardName::Name(s))
            }
            other_shapes!(ShardName::NotString; bool i64 u64 f64 unit seq map);
        }
        d.deserialize_any(V)
    }
}
