//! One guess budget for every login: the data ports' hellos, the feed's
//! PLAIN and CURVE logins, the admin port's bearer token.
//!
//! A token bucket of `rate` turns a second (burst: one second's worth). A
//! credential that does not match is answered only once it gets a turn,
//! and after `delay`, so no number of parallel connections, on however
//! many ports, learns the answers to guesses faster than `rate` a second;
//! one that matches is answered at once and spends none, so guessers
//! cannot hold a client with the right credential back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct GuessBudget {
    state: Mutex<(f64, Instant)>,
    rate: f64,
    /// Pause before a refusal is answered.
    pub delay: Duration,
    refused: AtomicU64,
}

impl GuessBudget {
    pub fn new(per_second: u32, delay: Duration) -> GuessBudget {
        let rate = f64::from(per_second.max(1));
        GuessBudget {
            state: Mutex::new((rate, Instant::now())),
            rate,
            delay,
            refused: AtomicU64::new(0),
        }
    }

    /// Waits for a turn until `deadline`; `false` past it, or as soon as
    /// `cancelled` says so (the connection was closed for a newcomer).
    pub fn take_turn(&self, deadline: Instant, cancelled: &dyn Fn() -> bool) -> bool {
        loop {
            let now = Instant::now();
            let wait = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let (tokens, last) = *state;
                let tokens = (tokens + now.duration_since(last).as_secs_f64() * self.rate)
                    .min(self.rate.max(1.0));
                if tokens >= 1.0 {
                    *state = (tokens - 1.0, now);
                    return true;
                }
                *state = (tokens, now);
                Duration::from_secs_f64((1.0 - tokens) / self.rate)
            };
            if now + wait > deadline || !pause(wait, cancelled) {
                return false;
            }
        }
    }

    /// A turn for a caller that cannot block (an async one): reserves the
    /// next turn and says how long from now the refusal may be answered
    /// (the turn's wait plus the pause), or `None`, reserving nothing, when
    /// that turn would come after `deadline`. Turns are reserved in order
    /// (the bucket goes into debt), so blocking and non-blocking callers
    /// share one rate.
    pub fn reserve_turn(&self, deadline: Instant) -> Option<Duration> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, last) = *state;
        let tokens =
            (tokens + now.duration_since(last).as_secs_f64() * self.rate).min(self.rate.max(1.0));
        let after = tokens - 1.0;
        let wait = if after >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-after / self.rate)
        };
        if now + wait > deadline {
            *state = (tokens, now);
            return None;
        }
        *state = (after, now);
        Some(wait + self.delay)
    }

    /// The pause before a refusal is answered; `false` if `cancelled` cut
    /// it short.
    pub fn refusal_pause(&self, cancelled: &dyn Fn() -> bool) -> bool {
        pause(self.delay, cancelled)
    }

    /// A refused credential, on any surface: counted once, where the
    /// metric of refused logins reads it.
    pub fn count_refusal(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// A whole refused login on a surface that has no connection to cancel
    /// it: a turn (until `deadline`), the pause, the count. `false` when no
    /// turn came before the deadline (the caller just closes).
    pub fn refuse(&self, deadline: Instant) -> bool {
        self.count_refusal();
        let never = || false;
        self.take_turn(deadline, &never) && self.refusal_pause(&never)
    }

    /// A full bucket again: for tests that check a refusal after spending
    /// the burst, without waiting a second.
    #[doc(hidden)]
    pub fn refill(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *state = (self.rate, Instant::now());
    }

    /// Refused credentials so far, on every surface.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// Sleeps `length` in slices of at most 10 ms, stopping early (`false`)
/// when `cancelled` says so.
fn pause(length: Duration, cancelled: &dyn Fn() -> bool) -> bool {
    let end = Instant::now() + length;
    loop {
        if cancelled() {
            return false;
        }
        let now = Instant::now();
        if now >= end {
            return true;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(10)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_come_at_the_rate_and_a_deadline_ends_the_wait() {
        let budget = GuessBudget::new(2, Duration::ZERO);
        let never = || false;
        let far = Instant::now() + Duration::from_secs(600);
        // The burst: one second's worth.
        assert!(budget.take_turn(far, &never) && budget.take_turn(far, &never));
        // Past it, turns come at the rate: of a hundred asks that do not
        // wait, nearly all are refused (all granted only if each ask took
        // half a second).
        let granted = (0..100)
            .filter(|_| budget.take_turn(Instant::now(), &never))
            .count();
        assert!(granted < 100, "{granted} of 100 turns without waiting");
        // Cancelled at once.
        assert!(!budget.take_turn(far, &|| true));
        budget.count_refusal();
        assert_eq!(budget.refused(), 1);
    }

    #[test]
    fn reserved_turns_queue_at_the_rate_and_include_the_pause() {
        let budget = GuessBudget::new(1, Duration::from_secs(1));
        let far = Instant::now() + Duration::from_secs(600);
        // Each refusal is answered after the pause, and turns are a second
        // apart (the rate) however much time passes between the asks: one
        // ask a second later finds a refilled bucket, never two turns.
        let answers: Vec<Instant> = (0..4)
            .map(|_| {
                let asked = Instant::now();
                let wait = budget.reserve_turn(far).unwrap();
                assert!(wait >= Duration::from_secs(1), "the pause: {wait:?}");
                asked + wait
            })
            .collect();
        for pair in answers.windows(2) {
            assert!(
                pair[1].duration_since(pair[0]) >= Duration::from_millis(999),
                "two turns closer than the rate allows"
            );
        }
        // A deadline before the next turn reserves nothing.
        assert_eq!(budget.reserve_turn(Instant::now()), None);
    }
}
