//! The wall clock as messages carry it: milliseconds since the Unix epoch.

/// Now, in milliseconds since the Unix epoch (0 for a clock before it): what a publish time,
/// a first failure and a scheduled send are measured in.
pub fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
