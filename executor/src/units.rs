//! Human-friendly sizes and durations in configuration.
//!
//! Sizes: a number of bytes, or a string such as `"4GiB"`, `"512 MB"`, `"1.5G"`.
//! `KB`/`MB`/`GB`/`TB` are powers of 1000; `KiB`/`MiB`/`GiB`/`TiB` and the bare
//! `K`/`M`/`G`/`T` are powers of 1024 (as `free -h` prints them). Units are
//! case-insensitive.
//!
//! Durations: a number of seconds, or a string such as `"500ms"`, `"30s"`, `"5m"`, `"1h"`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size in bytes.
///
/// ```
/// use rankexec_executor::ByteSize;
/// assert_eq!("4GiB".parse::<ByteSize>().unwrap().bytes(), 4 << 30);
/// assert_eq!("512 MB".parse::<ByteSize>().unwrap().bytes(), 512_000_000);
/// assert!("4 parsecs".parse::<ByteSize>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// A size string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid size `{0}`: expected bytes or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
)]
pub struct ByteSizeError(String);

fn split_number(s: &str) -> (&str, &str) {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    (s[..end].trim(), s[end..].trim())
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ByteSizeError(s.to_owned());
        let (num, unit) = split_number(s.trim());
        let value: f64 = num.parse().map_err(|_| err())?;
        let mult: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            "k" | "kib" => 1024.0,
            "m" | "mib" => 1024.0 * 1024.0,
            "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
            "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(err()),
        };
        let bytes = value * mult;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(err());
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut i = 0;
        while v >= 1024.0 && i < UNITS.len() - 1 {
            v /= 1024.0;
            i += 1;
        }
        if i == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{v:.1} {}", UNITS[i])
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// A duration in configuration.
///
/// ```
/// use std::time::Duration;
/// use rankexec_executor::Dur;
/// assert_eq!("250ms".parse::<Dur>().unwrap().0, Duration::from_millis(250));
/// assert_eq!("2m".parse::<Dur>().unwrap().0, Duration::from_secs(120));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Dur(pub Duration);

impl Dur {
    /// The longest duration a configuration accepts: 366 days. Deadlines are added to the
    /// current time, and a longer one means "never" in practice anyway.
    pub const MAX: Dur = Dur(Duration::from_secs(366 * 24 * 3600));

    fn checked(self, text: impl Into<String>) -> Result<Dur, DurError> {
        if self > Dur::MAX {
            Err(DurError::TooLong(text.into()))
        } else {
            Ok(self)
        }
    }
}

/// A duration that does not parse, or is too long.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurError {
    /// Not a duration.
    #[error("invalid duration `{0}`: expected seconds or a number with a unit (ms, s, m, h)")]
    Invalid(String),
    /// Longer than [`Dur::MAX`].
    #[error("duration `{0}` is longer than the 366 days allowed")]
    TooLong(String),
}

impl FromStr for Dur {
    type Err = DurError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || DurError::Invalid(s.to_owned());
        let (num, unit) = split_number(s.trim());
        let value: f64 = num.parse().map_err(|_| err())?;
        let secs = match unit.to_ascii_lowercase().as_str() {
            "ms" => value / 1000.0,
            "" | "s" => value,
            "m" | "min" => value * 60.0,
            "h" => value * 3600.0,
            _ => return Err(err()),
        };
        Duration::try_from_secs_f64(secs)
            .map_err(|_| err())
            .and_then(|d| Dur(d).checked(s))
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(f64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Duration::try_from_secs_f64(n)
                .map_err(|_| DurError::Invalid(n.to_string()))
                .and_then(|d| Dur(d).checked(n.to_string()))
                .map_err(serde::de::Error::custom),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}ms", self.0.as_millis()))
    }
}

impl From<Duration> for Dur {
    fn from(d: Duration) -> Self {
        Dur(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_people_write_them() {
        let cases = [
            ("0", 0),
            ("1024", 1024),
            ("4GiB", 4 << 30),
            ("4 gib", 4 << 30),
            ("4G", 4 << 30),
            ("1.5GiB", 3 << 29),
            ("512 MB", 512_000_000),
            ("512MiB", 512 << 20),
            ("2kb", 2000),
            ("3 B", 3),
        ];
        for (s, want) in cases {
            assert_eq!(s.parse::<ByteSize>().unwrap().bytes(), want, "{s}");
        }
        for bad in ["", "GiB", "-1GiB", "4 XB", "1e999GB", "four"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad}");
        }
        let from_json: ByteSize = serde_json::from_str("\"2 GiB\"").unwrap();
        assert_eq!(from_json.bytes(), 2 << 30);
        let from_num: ByteSize = serde_json::from_str("77").unwrap();
        assert_eq!(from_num.bytes(), 77);
    }

    #[test]
    fn durations_parse() {
        assert_eq!("1.5".parse::<Dur>().unwrap().0, Duration::from_millis(1500));
        assert_eq!("1h".parse::<Dur>().unwrap().0, Duration::from_secs(3600));
        assert!("soon".parse::<Dur>().is_err());
        assert_eq!("366d".parse::<Dur>(), Err(DurError::Invalid("366d".into())));
        assert_eq!(
            "8785h".parse::<Dur>(),
            Err(DurError::TooLong("8785h".into())),
            "366 days is 8784 h"
        );
        assert_eq!("8784h".parse::<Dur>(), Ok(Dur::MAX));
        let d: Dur = serde_json::from_str("0.25").unwrap();
        assert_eq!(d.0, Duration::from_millis(250));
    }
}
