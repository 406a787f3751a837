//! Jitter for the waits idem controls itself.

use std::time::Duration;

/// `delay` less up to a quarter of it, at random: the waits idem controls itself (a retry in
/// place, a store's probe, a dead letter's record written again, a retry copy's due time on a
/// broker that delays each message on its own) are jittered with it, so that the failures of
/// one moment are not all tried again at the same moment.
pub fn jittered(delay: Duration) -> Duration {
    delay.mul_f64(1.0 - fastrand::f64() * 0.25)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_takes_off_at_most_a_quarter_and_spreads() {
        let waits: Vec<Duration> = (0..1000)
            .map(|_| jittered(Duration::from_secs(4)))
            .collect();
        assert!(
            waits
                .iter()
                .all(|w| *w > Duration::from_secs(3) && *w <= Duration::from_secs(4)),
            "{waits:?}"
        );
        let distinct: std::collections::HashSet<_> = waits.iter().collect();
        assert!(distinct.len() > 900, "{} distinct waits", distinct.len());
    }
}
