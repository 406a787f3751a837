//! How transient failures are retried: exponential backoff up to a number of attempts.

use std::time::Duration;

/// Exponential backoff: after failed attempt `n` (from 1), wait `initial × multiplier^(n-1)`,
/// capped at `max_delay`; after `max_attempts` attempts, dead-letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial: Duration,
    multiplier: u32,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, waiting 1 s, 4 s, 16 s and 60 s between them.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial: Duration::from_secs(1),
            multiplier: 4,
            max_delay: Duration::from_secs(60),
        }
    }
}

/// A retry policy that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry policy: {0}")]
pub struct RetryPolicyError(&'static str);

impl RetryPolicy {
    /// A policy of `max_attempts` attempts in all, the first retry after `initial`, each next
    /// one `multiplier` times later, at most `max_delay`.
    pub fn new(
        max_attempts: u32,
        initial: Duration,
        multiplier: u32,
        max_delay: Duration,
    ) -> Result<Self, RetryPolicyError> {
        if max_attempts == 0 {
            return Err(RetryPolicyError("max_attempts must be at least 1"));
        }
        if initial < Duration::from_millis(1) || multiplier == 0 || max_delay < initial {
            return Err(RetryPolicyError(
                "delays must be at least 1 ms, the multiplier at least 1, and max_delay at least the initial delay",
            ));
        }
        Ok(Self {
            max_attempts,
            initial,
            multiplier,
            max_delay,
        })
    }

    /// The number of attempts before a message is dead-lettered.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// How long to wait after failed attempt `attempt`, or `None` when it was the last.
    pub fn delay_after(&self, attempt: u32) -> Option<Duration> {
        if attempt >= self.max_attempts {
            return None;
        }
        let factor = self.multiplier.saturating_pow(attempt.saturating_sub(1));
        Some(self.initial.saturating_mul(factor).min(self.max_delay))
    }

    /// How long a message's retries wait in all, from its first failure to its last attempt:
    /// every delay of the policy, added up.
    pub fn total_delay(&self) -> Duration {
        (1..self.max_attempts)
            .filter_map(|a| self.delay_after(a))
            .fold(Duration::ZERO, Duration::saturating_add)
    }

    /// Every delay the policy can ask for, shortest first, without repeats: the transport
    /// prepares one delay queue for each.
    pub fn delays(&self) -> Vec<Duration> {
        let mut delays: Vec<_> = (1..self.max_attempts)
            .filter_map(|a| self.delay_after(a))
            .collect();
        delays.dedup();
        delays
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_schedule() {
        let p = RetryPolicy::default();
        let secs = |a| p.delay_after(a).map(|d| d.as_secs());
        assert_eq!(
            [secs(1), secs(2), secs(3), secs(4), secs(5)],
            [Some(1), Some(4), Some(16), Some(60), None]
        );
        assert_eq!(p.delays().len(), 4);
        let flat =
            RetryPolicy::new(4, Duration::from_millis(50), 1, Duration::from_millis(50)).unwrap();
        assert_eq!(flat.delays(), vec![Duration::from_millis(50)]);
        assert!(RetryPolicy::new(0, Duration::from_secs(1), 2, Duration::from_secs(1)).is_err());
        assert_eq!(
            RetryPolicy::new(1, Duration::from_secs(1), 2, Duration::from_secs(1))
                .unwrap()
                .delay_after(1),
            None
        );
    }
}
