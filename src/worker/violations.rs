//! Counting protocol violations in a sliding window.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Counts violations of one worker; `limit` of them within `window` make it faulty.
///
/// Owned by the dispatcher, which hears of every violation (the reader thread reports framing
/// violations as events).
#[derive(Debug)]
pub struct ViolationWindow {
    limit: usize,
    window: Duration,
    recent: VecDeque<Instant>,
    total: u64,
    tripped: bool,
}

impl ViolationWindow {
    /// A window that trips at the `limit`-th violation within `window`.
    pub fn new(limit: usize, window: Duration) -> ViolationWindow {
        ViolationWindow {
            limit: limit.max(1),
            window,
            recent: VecDeque::new(),
            total: 0,
            tripped: false,
        }
    }

    /// Records one violation at `now`. Returns `true` exactly once: when this violation trips the
    /// limit.
    pub fn record(&mut self, now: Instant) -> bool {
        self.total += 1;
        while let Some(&oldest) = self.recent.front() {
            if now.duration_since(oldest) >= self.window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
        self.recent.push_back(now);
        if self.recent.len() >= self.limit && !self.tripped {
            self.tripped = true;
            return true;
        }
        false
    }

    /// Violations seen over the worker's life.
    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_once_at_the_limit_within_the_window() {
        let start = Instant::now();
        let mut window = ViolationWindow::new(3, Duration::from_secs(60));
        assert!(!window.record(start));
        assert!(!window.record(start + Duration::from_secs(1)));
        assert!(window.record(start + Duration::from_secs(2)));
        assert!(!window.record(start + Duration::from_secs(3)));
        assert_eq!(window.total(), 4);
    }

    #[test]
    fn old_violations_leave_the_window() {
        let start = Instant::now();
        let mut window = ViolationWindow::new(3, Duration::from_secs(10));
        assert!(!window.record(start));
        assert!(!window.record(start + Duration::from_secs(1)));
        assert!(!window.record(start + Duration::from_secs(11)));
        assert!(!window.record(start + Duration::from_secs(12)));
        assert!(window.record(start + Duration::from_secs(13)));
    }
}
