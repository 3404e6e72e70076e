//! JSON exactly as K3's Python renderer writes it.
//!
//! The reference renderer uses Python's `json`: `json.loads` keeps object keys in
//! document order (the last duplicate wins, in the first one's place), and
//! `json.dumps(..., ensure_ascii=False)` writes floats with Python's `repr`
//! (`1e-05`, `100.0`) and escapes only `"`, `\` and control characters. Tool
//! argument values are written with the default separators (`", "`, `": "`),
//! tool declarations compactly with keys sorted. `serde_json` does none of this
//! byte for byte, so this small value type does.
//!
//! Known gap: integers beyond 64 bits are read as floats (`serde_json` without
//! `arbitrary_precision`), where Python would keep every digit.

use std::fmt::{self, Write as _};

use rustc_hash::FxHashMap;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value with object keys in document order, as Python's `json.loads` gives.
#[derive(Debug, Clone, PartialEq)]
pub enum PyJson {
    /// `null` (`None`).
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer literal (`int`).
    Int(i128),
    /// A number with a fraction or exponent (`float`).
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<PyJson>),
    /// An object, keys in document order.
    Object(Vec<(String, PyJson)>),
}

/// Separators between items and between a key and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Separators {
    /// `json.dumps` defaults: `", "` and `": "`.
    Python,
    /// `separators=(",", ":")`.
    Compact,
}

impl PyJson {
    /// Parses JSON text, keeping key order (`json.loads`).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Converts a `serde_json::Value`, sorting every object's keys (the
    /// reference renderer's `deep_sort_dict`).
    pub fn sorted_from_value(value: &serde_json::Value) -> Self {
        use serde_json::Value;
        match value {
            Value::Null => Self::Null,
            Value::Bool(b) => Self::Bool(*b),
            Value::Number(n) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Self::Int(i128::from(i)),
                (None, Some(u)) => Self::Int(i128::from(u)),
                // A JSON number that is neither i64 nor u64 is an f64.
                _ => Self::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            Value::String(s) => Self::Str(s.clone()),
            Value::Array(items) => Self::Array(items.iter().map(Self::sorted_from_value).collect()),
            Value::Object(map) => {
                let mut entries: Vec<(String, Self)> = map
                    .iter()
                    .map(|(k, v)| (k.clone(), Self::sorted_from_value(v)))
                    .collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                Self::Object(entries)
            }
        }
    }

    /// The XTML `type` attribute of a tool-call argument with this value.
    pub fn xtml_type(&self) -> &'static str {
        match self {
            Self::Bool(_) => "boolean",
            Self::Null => "null",
            Self::Int(_) | Self::Float(_) => "number",
            Self::Str(_) => "string",
            Self::Object(_) => "object",
            Self::Array(_) => "array",
        }
    }

    /// `json.dumps(self, ensure_ascii=False, separators=...)`.
    pub fn dumps(&self, separators: Separators) -> String {
        let mut out = String::new();
        self.write(&mut out, separators);
        out
    }

    fn write(&self, out: &mut String, separators: Separators) {
        let (item_sep, key_sep) = match separators {
            Separators::Python => (", ", ": "),
            Separators::Compact => (",", ":"),
        };
        match self {
            Self::Null => out.push_str("null"),
            Self::Bool(true) => out.push_str("true"),
            Self::Bool(false) => out.push_str("false"),
            Self::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Self::Float(f) => write_python_float(out, *f),
            Self::Str(s) => write_string(out, s),
            Self::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    item.write(out, separators);
                }
                out.push(']');
            }
            Self::Object(entries) => {
                out.push('{');
                for (i, (key, value)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    write_string(out, key);
                    out.push_str(key_sep);
                    value.write(out, separators);
                }
                out.push('}');
            }
        }
    }
}

/// A JSON string literal as Python writes it with `ensure_ascii=False`.
pub fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (as `json.dumps` uses it): the shortest digits that
/// round-trip, positional for decimal exponents in `-4..16`, else scientific
/// with a signed two-digit-minimum exponent.
pub fn write_python_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // `{:e}` gives the shortest round-trip digits, e.g. "-1.5e-5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    out.push_str(sign);
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
}

impl<'de> Deserialize<'de> for PyJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PyJsonVisitor)
    }
}

struct PyJsonVisitor;

impl<'de> Visitor<'de> for PyJsonVisitor {
    type Value = PyJson;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<PyJson, E> {
        Ok(PyJson::Null)
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<PyJson, E> {
        Ok(PyJson::Bool(b))
    }

    fn visit_i64<E: de::Error>(self, i: i64) -> Result<PyJson, E> {
        Ok(PyJson::Int(i128::from(i)))
    }

    fn visit_u64<E: de::Error>(self, u: u64) -> Result<PyJson, E> {
        Ok(PyJson::Int(i128::from(u)))
    }

    fn visit_f64<E: de::Error>(self, f: f64) -> Result<PyJson, E> {
        Ok(PyJson::Float(f))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<PyJson, E> {
        Ok(PyJson::Str(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<PyJson, E> {
        Ok(PyJson::Str(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PyJson, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(PyJson::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PyJson, A::Error> {
        let mut entries: Vec<(String, PyJson)> = Vec::new();
        let mut index: FxHashMap<String, usize> = FxHashMap::default();
        while let Some((key, value)) = map.next_entry::<String, PyJson>()? {
            // Python dicts keep a repeated key in its first position with its last value.
            match index.get(&key) {
                Some(&i) => entries[i].1 = value,
                None => {
                    index.insert(key.clone(), entries.len());
                    entries.push((key, value));
                }
            }
        }
        Ok(PyJson::Object(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases: [(f64, &str); 12] = [
            (1.0, "1.0"),
            (100.0, "100.0"),
            (0.1, "0.1"),
            (1.5e-5, "1.5e-05"),
            (1e-4, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.2345e15, "1234500000000000.0"),
            (-2.5, "-2.5"),
            (-0.0, "-0.0"),
            (1e300, "1e+300"),
            (3.14e-100, "3.14e-100"),
        ];
        for (f, expected) in cases {
            let mut out = String::new();
            write_python_float(&mut out, f);
            assert_eq!(out, expected, "{f}");
        }
    }

    #[test]
    fn keeps_order_and_python_separators() {
        let value =
            PyJson::parse(r#"{"b": 1, "a": [true, null, 2.50, "x\"\u0001é"], "b": {"z": 1e2}}"#);
        let Ok(value) = value else {
            panic!("parse failed: {value:?}")
        };
        assert_eq!(
            value.dumps(Separators::Python),
            r#"{"b": {"z": 100.0}, "a": [true, null, 2.5, "x\"\u0001é"]}"#
        );
        assert_eq!(
            value.dumps(Separators::Compact),
            r#"{"b":{"z":100.0},"a":[true,null,2.5,"x\"\u0001é"]}"#
        );
    }
}
