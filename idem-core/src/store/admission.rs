//! [`Admission`]: what a key's state in the inbox means for a new request for it. The one place
//! where the claim protocol's answers ([`Claim`], [`Lease`]) are judged (run it, come back
//! later, replay it, refuse it as failed before, or refuse it as a conflict), for every entry
//! point: the runtime's pipelines and the HTTP layer. A new answer of a store is handled here.

use super::inbox::Claim;
use super::lease::Lease;
use crate::model::{Fingerprint, StoredOutput};
use std::time::Duration;

/// Whether a request for a key runs, judged from the inbox's answer to its claim or lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// The key is this request's: run it. `attempts` counts the runs granted on the key so far,
    /// this one included (1 for a new key; more when an expired lease was taken over).
    Run {
        /// Runs granted on the key, this one included.
        attempts: u32,
    },
    /// The key is not this request's; why.
    Refused(Refusal),
}

/// Why a request for a key does not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The same request is running elsewhere now; `remaining` is how long its lease still runs,
    /// when the store knows (a claim blocked by another transaction does not say).
    Busy {
        /// How long the other run's lease still runs.
        remaining: Option<Duration>,
    },
    /// The same request completed: its stored output (`None` for `null`).
    Duplicate {
        /// The stored output.
        output: Option<StoredOutput>,
    },
    /// The same request failed for good; it is not run again. Its stored output.
    Failed {
        /// The stored failure.
        output: Option<StoredOutput>,
    },
    /// The key was used for a different payload: the same key, another fingerprint.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
    },
}

impl Admission {
    /// The admission of a request with fingerprint `received` from a transactional claim's
    /// answer; `None` is a non-blocking claim ([`crate::store::InboxStore::try_claim`]) that found the
    /// key locked by another transaction.
    pub fn of_claim(claim: Option<Claim>, received: &Fingerprint) -> Self {
        match claim {
            Some(Claim::Claimed) => Self::Run { attempts: 1 },
            Some(Claim::Existing {
                fingerprint,
                output,
            }) => Self::Refused(Refusal::of_existing(fingerprint, output, received)),
            None => Self::Refused(Refusal::Busy { remaining: None }),
        }
    }

    /// The admission of a request with fingerprint `received` from a lease's answer (external
    /// mode). A key held, completed or failed under another fingerprint is a conflict.
    pub fn of_lease(lease: Lease, received: &Fingerprint) -> Self {
        let judged = |stored: Fingerprint, same: Refusal| match stored == *received {
            true => Self::Refused(same),
            false => Self::Refused(Refusal::Conflict { stored }),
        };
        match lease {
            Lease::Acquired { attempts } => Self::Run { attempts },
            Lease::Held {
                fingerprint,
                remaining,
            } => judged(
                fingerprint,
                Refusal::Busy {
                    remaining: Some(remaining),
                },
            ),
            Lease::Completed {
                fingerprint,
                output,
            } => judged(fingerprint, Refusal::Duplicate { output }),
            Lease::Failed {
                fingerprint,
                output,
            } => judged(fingerprint, Refusal::Failed { output }),
        }
    }
}

impl Refusal {
    /// A key recorded with fingerprint `stored` and `output`, met again by a request with
    /// fingerprint `received`: a duplicate when they are equal, else a conflict.
    pub fn of_existing(
        stored: Fingerprint,
        output: Option<StoredOutput>,
        received: &Fingerprint,
    ) -> Self {
        match stored == *received {
            true => Self::Duplicate { output },
            false => Self::Conflict { stored },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of(body.as_bytes())
    }

    #[test]
    fn a_claim_runs_a_new_key_and_judges_an_existing_one_by_its_fingerprint() {
        let (a, b) = (fp("a"), fp("b"));
        assert_eq!(
            Admission::of_claim(Some(Claim::Claimed), &a),
            Admission::Run { attempts: 1 }
        );
        let existing = || {
            Some(Claim::Existing {
                fingerprint: a,
                output: None,
            })
        };
        assert_eq!(
            Admission::of_claim(existing(), &a),
            Admission::Refused(Refusal::Duplicate { output: None })
        );
        assert_eq!(
            Admission::of_claim(existing(), &b),
            Admission::Refused(Refusal::Conflict { stored: a })
        );
        assert_eq!(
            Admission::of_claim(None, &a),
            Admission::Refused(Refusal::Busy { remaining: None })
        );
    }

    #[test]
    fn a_lease_held_completed_or_failed_under_another_fingerprint_is_a_conflict() {
        let (a, b) = (fp("a"), fp("b"));
        let remaining = Duration::from_secs(3);
        let answers = |fingerprint: Fingerprint| {
            [
                Lease::Held {
                    fingerprint,
                    remaining,
                },
                Lease::Completed {
                    fingerprint,
                    output: None,
                },
                Lease::Failed {
                    fingerprint,
                    output: None,
                },
            ]
        };
        let same: Vec<Admission> = answers(a)
            .into_iter()
            .map(|l| Admission::of_lease(l, &a))
            .collect();
        assert_eq!(
            same,
            [
                Admission::Refused(Refusal::Busy {
                    remaining: Some(remaining)
                }),
                Admission::Refused(Refusal::Duplicate { output: None }),
                Admission::Refused(Refusal::Failed { output: None }),
            ]
        );
        for lease in answers(a) {
            assert_eq!(
                Admission::of_lease(lease, &b),
                Admission::Refused(Refusal::Conflict { stored: a })
            );
        }
        assert_eq!(
            Admission::of_lease(Lease::Acquired { attempts: 2 }, &a),
            Admission::Run { attempts: 2 }
        );
    }
}
