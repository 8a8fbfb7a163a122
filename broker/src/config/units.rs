//! Parsers and bounds of sizes and durations the settings share.

/// A size in bytes: a number, optionally followed by a unit (`k`, `M`, `G`, `T`, with or
/// without `iB`/`B`; all powers of 1024).
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 1073741824 or 1GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Longest timeout any `*_MS` setting may hold: a day. Far above any real use, and far
/// enough below `u64::MAX` that no deadline arithmetic can overflow.
pub(crate) const MAX_MILLIS: u64 = 86_400_000;

/// Largest size any `*_MB` setting may hold: 1 TiB, so that converting it to bytes cannot
/// overflow (and no host has more).
pub(crate) const MAX_MEBIBYTES: u64 = 1 << 20;

/// Largest request body: bodies are buffered in memory, so 4 GiB is already absurd.
pub(crate) const MAX_BODY_MB: u64 = 4096;

/// A `*_MS` setting: 1 ms to [`MAX_MILLIS`].
pub(crate) fn millis() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=MAX_MILLIS)
}

/// A `*_SECS` setting: 0 to a day.
pub(crate) fn secs() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(0..=MAX_MILLIS / 1000)
}

/// A `*_MB` setting: `min` to [`MAX_MEBIBYTES`].
pub(crate) fn mebibytes(min: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(min..=MAX_MEBIBYTES)
}
