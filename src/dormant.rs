//! [`DormantSessions`]: the sessions the dispatcher holds no state for, with the load they put
//! on their slots.
//!
//! A session is dormant when it was found in the journal at start and not used since, or when it
//! was passivated or closed since: it costs its id and its placement, and it is recovered from the
//! journal when a command next names it. Placing a new session needs, for every slot, how many
//! sessions live there; dormant ones can be most of a long-running Brain's sessions, so they are
//! counted as they come and go instead of walked on every create.

use crate::session::{SessionId, SessionIdMap};
use std::collections::HashMap;

/// Where a dormant session lives, and how it became dormant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dormant {
    /// The registration's index (or the index meaning none, for a registration a restart dropped).
    pub(crate) registration: usize,
    pub(crate) slot: u32,
    pub(crate) since: Since,
}

/// How a session became dormant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Since {
    /// Found in the journal at start: its status is not read, and it may need recovering (an
    /// activation a stopped Brain left running) before anything is said of it. It counts toward
    /// its slot's load.
    Start,
    /// Passivated, idle: it counts toward its slot's load.
    Passivated,
    /// Closed, idle: it does not count, and it can be deleted without being loaded.
    Closed,
}

impl Dormant {
    fn counts(self) -> bool {
        self.since != Since::Closed
    }
}

/// The dormant sessions by id, and per (registration, slot) how many of them count.
#[derive(Default)]
pub(crate) struct DormantSessions {
    sessions: SessionIdMap<SessionId, Dormant>,
    load: HashMap<(usize, u32), usize>,
}

impl DormantSessions {
    /// Sessions found in the journal at start: each counts, its status unread.
    pub(crate) fn found_at_start(
        found: impl IntoIterator<Item = (SessionId, (usize, u32))>,
    ) -> Self {
        let mut dormant = DormantSessions::default();
        for (id, (registration, slot)) in found {
            dormant.insert(
                id,
                Dormant {
                    registration,
                    slot,
                    since: Since::Start,
                },
            );
        }
        dormant
    }

    /// Makes `id` dormant (replacing what it was, if it already was).
    pub(crate) fn insert(&mut self, id: SessionId, dormant: Dormant) {
        if let Some(before) = self.sessions.insert(id, dormant) {
            self.uncount(before);
        }
        if dormant.counts() {
            *self
                .load
                .entry((dormant.registration, dormant.slot))
                .or_default() += 1;
        }
    }

    /// Takes `id` out (it is being loaded, or it is gone); `None` when it was not dormant.
    pub(crate) fn remove(&mut self, id: &SessionId) -> Option<Dormant> {
        let dormant = self.sessions.remove(id)?;
        self.uncount(dormant);
        Some(dormant)
    }

    /// `id`'s placement, when it is dormant.
    pub(crate) fn get(&self, id: &SessionId) -> Option<Dormant> {
        self.sessions.get(id).copied()
    }

    /// `id`'s placement, when it is dormant because it was closed: such a session is answered
    /// (described, closed again, deleted) without being loaded.
    pub(crate) fn closed(&self, id: &SessionId) -> Option<Dormant> {
        self.get(id)
            .filter(|dormant| dormant.since == Since::Closed)
    }

    /// How many dormant sessions count toward `slot` of `registration`.
    pub(crate) fn load(&self, registration: usize, slot: u32) -> usize {
        self.load.get(&(registration, slot)).copied().unwrap_or(0)
    }

    pub(crate) fn ids(&self) -> impl Iterator<Item = &SessionId> {
        self.sessions.keys()
    }

    fn uncount(&mut self, dormant: Dormant) {
        if !dormant.counts() {
            return;
        }
        let key = (dormant.registration, dormant.slot);
        if let Some(count) = self.load.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                self.load.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> SessionId {
        SessionId::generate().expect("a session id")
    }

    fn at(registration: usize, slot: u32, since: Since) -> Dormant {
        Dormant {
            registration,
            slot,
            since,
        }
    }

    #[test]
    fn the_load_follows_the_sessions_that_count_as_they_come_and_go() {
        let (a, b, c) = (id(), id(), id());
        let mut dormant = DormantSessions::found_at_start([(a.clone(), (0, 1))]);
        assert_eq!(dormant.load(0, 1), 1, "found at start: counts");
        dormant.insert(b.clone(), at(0, 1, Since::Passivated));
        dormant.insert(c.clone(), at(0, 1, Since::Closed));
        assert_eq!(
            (dormant.load(0, 1), dormant.ids().count()),
            (2, 3),
            "a closed one does not count"
        );
        assert_eq!(dormant.load(0, 0), 0);
        assert_eq!(dormant.load(1, 1), 0, "another registration's slot 1");
        assert_eq!(dormant.closed(&c), Some(at(0, 1, Since::Closed)));
        assert_eq!((dormant.closed(&a), dormant.closed(&b)), (None, None));

        // Made dormant again with another placement or status: counted once, where it is now.
        dormant.insert(b.clone(), at(0, 0, Since::Passivated));
        assert_eq!((dormant.load(0, 1), dormant.load(0, 0)), (1, 1));
        dormant.insert(b.clone(), at(0, 0, Since::Closed));
        assert_eq!((dormant.load(0, 0), dormant.ids().count()), (0, 3));

        assert_eq!(dormant.remove(&a), Some(at(0, 1, Since::Start)));
        assert_eq!(dormant.remove(&a), None, "removed once");
        assert_eq!(dormant.load(0, 1), 0);
        assert_eq!(dormant.remove(&c), Some(at(0, 1, Since::Closed)));
        assert_eq!(
            dormant.load(0, 1),
            0,
            "removing one that did not count takes nothing"
        );
        assert_eq!(dormant.ids().collect::<Vec<_>>(), [&b]);
    }
}
