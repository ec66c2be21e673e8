//! Criticality and admission: who gets in when a pool is saturated.
//!
//! Three classes, as in the Gateway API Inference Extension: `critical`, `standard` (default),
//! `sheddable`. A pool is saturated when its in-flight count reaches its capacity (the proxy's own
//! accounting), and sheddable traffic is also refused while the controller reports the pool's
//! saturation at or above a threshold. Then:
//! - sheddable: refused at once (429 with Retry-After);
//! - standard: waits in a bounded FIFO queue; refused when the queue is full or the wait times out;
//! - critical: waits ahead of every standard request, and when the queue is full it takes the place
//!   of the newest standard waiter (who is refused) — critical always goes first.
//!
//! A [`Permit`] is one slot of capacity. Dropping it hands the slot straight to the next waiter
//! (critical first), so a freed slot is never stolen by a newcomer while others wait.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Criticality {
    Critical,
    #[default]
    Standard,
    Sheddable,
}

impl Criticality {
    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Critical => "critical",
            Criticality::Standard => "standard",
            Criticality::Sheddable => "sheddable",
        }
    }

    pub fn parse(s: &str) -> Option<Criticality> {
        match s.trim().to_ascii_lowercase().as_str() {
            "critical" => Some(Criticality::Critical),
            "standard" => Some(Criticality::Standard),
            "sheddable" => Some(Criticality::Sheddable),
            _ => None,
        }
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Sheddable request while the pool is saturated.
    Shed,
    /// The wait queue is full.
    QueueFull,
    /// Waited `queue_timeout` without a slot.
    QueueTimeout,
    /// A critical request took this standard request's place in the full queue.
    Displaced,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Shed => "shed",
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
            Refusal::Displaced => "displaced",
        }
    }
}

struct Waiter {
    id: u64,
    tx: oneshot::Sender<Result<Permit, Refusal>>,
}

#[derive(Default)]
struct State {
    in_flight: usize,
    critical: VecDeque<Waiter>,
    standard: VecDeque<Waiter>,
    next_id: u64,
}

impl State {
    fn queued(&self) -> usize {
        self.critical.len() + self.standard.len()
    }
}

struct Inner {
    /// `None`: no limit from the proxy's own count.
    capacity: Option<usize>,
    queue_size: usize,
    state: Mutex<State>,
}

/// The admission gate of one pool.
#[derive(Clone)]
pub struct Admission {
    inner: Arc<Inner>,
}

/// One admitted request. Dropping it frees the slot for the next waiter.
pub struct Permit {
    inner: Arc<Inner>,
    armed: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.armed {
            release(&self.inner);
        }
    }
}

fn lock(inner: &Inner) -> MutexGuard<'_, State> {
    match inner.state.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Give the slot to the next live waiter, or return it to the pool.
fn release(inner: &Arc<Inner>) {
    loop {
        let next = {
            let mut st = lock(inner);
            match st.critical.pop_front().or_else(|| st.standard.pop_front()) {
                Some(w) => w,
                None => {
                    st.in_flight = st.in_flight.saturating_sub(1);
                    return;
                }
            }
        };
        // The slot moves with the permit: in_flight is unchanged.
        match next.tx.send(Ok(Permit { inner: inner.clone(), armed: true })) {
            Ok(()) => return,
            Err(Ok(mut p)) => p.armed = false, // that waiter gave up; try the next one
            Err(Err(_)) => {}
        }
    }
}

impl Admission {
    pub fn new(capacity: Option<usize>, queue_size: usize) -> Admission {
        Admission { inner: Arc::new(Inner { capacity, queue_size, state: Mutex::new(State::default()) }) }
    }

    /// Requests admitted and not finished.
    pub fn in_flight(&self) -> usize {
        lock(&self.inner).in_flight
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        lock(&self.inner).queued()
    }

    pub fn capacity(&self) -> Option<usize> {
        self.inner.capacity
    }

    /// Admit a request of class `class`. `controller_saturated`: the controller says the pool is at or
    /// above its shedding threshold.
    pub async fn admit(
        &self,
        class: Criticality,
        controller_saturated: bool,
        timeout: Duration,
    ) -> Result<Permit, Refusal> {
        let rx = {
            let mut st = lock(&self.inner);
            let full = self.inner.capacity.is_some_and(|c| st.in_flight >= c);
            if class == Criticality::Sheddable && (full || controller_saturated) {
                return Err(Refusal::Shed);
            }
            // Waiters only exist while the pool is full (a freed slot goes straight to them), so a
            // newcomer that finds room jumps no queue.
            if !full {
                st.in_flight += 1;
                return Ok(Permit { inner: self.inner.clone(), armed: true });
            }
            if st.queued() >= self.inner.queue_size {
                match class {
                    Criticality::Critical => match st.standard.pop_back() {
                        Some(w) => {
                            let _ = w.tx.send(Err(Refusal::Displaced));
                        }
                        None => return Err(Refusal::QueueFull),
                    },
                    _ => return Err(Refusal::QueueFull),
                }
            }
            let (tx, rx) = oneshot::channel();
            let id = st.next_id;
            st.next_id += 1;
            let w = Waiter { id, tx };
            if class == Criticality::Critical {
                st.critical.push_back(w);
            } else {
                st.standard.push_back(w);
            }
            (id, rx)
        };
        let (id, mut rx) = rx;
        // Leaves the queue on every exit, including this future being dropped (the client went
        // away while waiting): a waiter that is gone must not hold a queue place.
        let mut place = QueuePlace { inner: &self.inner, id, left: false };
        match tokio::time::timeout(timeout, &mut rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Refusal::QueueTimeout),
            Err(_) => {
                place.leave();
                // A permit may have been handed over between the timeout and leaving: take it
                // (better than wasting it) instead of dropping it.
                match rx.try_recv() {
                    Ok(r) => r,
                    Err(_) => Err(Refusal::QueueTimeout),
                }
            }
        }
    }
}

/// A waiter's place in the queue, removed when it is dropped. If the waiter is already gone from
/// the queue (handed a permit or displaced), removing it is a no-op; a permit sent to a waiter that
/// then went away is dropped with its channel, which hands the slot on.
struct QueuePlace<'a> {
    inner: &'a Arc<Inner>,
    id: u64,
    left: bool,
}

impl QueuePlace<'_> {
    fn leave(&mut self) {
        if !self.left {
            self.left = true;
            let mut st = lock(self.inner);
            let id = self.id;
            st.critical.retain(|w| w.id != id);
            st.standard.retain(|w| w.id != id);
        }
    }
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn sheddable_is_refused_when_full_or_when_the_controller_says_so() {
        let a = Admission::new(Some(1), 4);
        let p = a.admit(Criticality::Standard, false, T).await.unwrap();
        assert_eq!(a.admit(Criticality::Sheddable, false, T).await.err(), Some(Refusal::Shed));
        drop(p);
        assert!(a.admit(Criticality::Sheddable, false, T).await.is_ok());
        assert_eq!(a.admit(Criticality::Sheddable, true, T).await.err(), Some(Refusal::Shed));
        assert!(a.admit(Criticality::Standard, true, T).await.is_ok(), "controller saturation only sheds");
    }

    #[tokio::test]
    async fn critical_goes_before_standard_and_slots_are_handed_over() {
        let a = Admission::new(Some(1), 8);
        let first = a.admit(Criticality::Standard, false, T).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, c) in [(0, Criticality::Standard), (1, Criticality::Standard), (2, Criticality::Critical)] {
            let a2 = a.clone();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                let p = a2.admit(c, false, T).await.unwrap();
                order.lock().unwrap().push(i);
                drop(p);
            }));
            // Queue them in this order.
            while a.queued() < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![2, 0, 1]);
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test]
    async fn full_queue_refuses_standard_and_critical_displaces_the_newest_standard() {
        let a = Admission::new(Some(1), 1);
        let _busy = a.admit(Criticality::Standard, false, T).await.unwrap();
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.admit(Criticality::Standard, false, T).await.err() });
        while a.queued() < 1 {
            tokio::task::yield_now().await;
        }
        assert_eq!(a.admit(Criticality::Standard, false, T).await.err(), Some(Refusal::QueueFull));
        let a3 = a.clone();
        let crit = tokio::spawn(async move { a3.admit(Criticality::Critical, false, T).await.is_ok() });
        assert_eq!(waiting.await.unwrap(), Some(Refusal::Displaced));
        drop(_busy);
        assert!(crit.await.unwrap());
    }

    #[tokio::test]
    async fn queue_timeout_leaves_no_leak() {
        let a = Admission::new(Some(1), 4);
        let p = a.admit(Criticality::Standard, false, T).await.unwrap();
        let r = a.admit(Criticality::Standard, false, Duration::from_millis(20)).await;
        assert_eq!(r.err(), Some(Refusal::QueueTimeout));
        assert_eq!(a.queued(), 0);
        drop(p);
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_goes_away_leaves_the_queue_and_its_slot_passes_on() {
        let a = Admission::new(Some(1), 1);
        let busy = a.admit(Criticality::Standard, false, T).await.unwrap();
        let a2 = a.clone();
        let gone = tokio::spawn(async move { a2.admit(Criticality::Standard, false, T).await.is_ok() });
        while a.queued() < 1 {
            tokio::task::yield_now().await;
        }
        gone.abort();
        let _ = gone.await;
        assert_eq!(a.queued(), 0, "an abandoned waiter must not keep its queue place");
        // The queue (size 1) has room again, and the slot goes to the next live waiter.
        let a3 = a.clone();
        let next = tokio::spawn(async move { a3.admit(Criticality::Standard, false, T).await.is_ok() });
        while a.queued() < 1 {
            tokio::task::yield_now().await;
        }
        drop(busy);
        assert!(next.await.unwrap());
        assert_eq!((a.in_flight(), a.queued()), (0, 0));
    }

    #[test]
    fn parse_classes() {
        assert_eq!(Criticality::parse(" Critical "), Some(Criticality::Critical));
        assert_eq!(Criticality::parse("low"), None);
    }
}
