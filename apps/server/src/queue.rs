//! The engine's FIFO queue: one generation runs, up to `max_waiting` requests wait their turn in arrival order,
//! and a request that finds the queue full is refused (429).
//!
//! A request holds a [`Ticket`] while it waits and an [`EnginePermit`] while it runs. Both release their place on
//! drop: a waiter whose client disconnects (its handler or its response stream is dropped) leaves the queue, and
//! the next one moves up. Every change bumps a `watch` counter that waiters await, so no wake-up is lost.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

#[derive(Debug, Default)]
struct State {
    running: bool,
    waiting: VecDeque<u64>,
    next_ticket: u64,
}

/// The queue in front of the engine.
#[derive(Debug)]
pub struct EngineQueue {
    state: Mutex<State>,
    max_waiting: usize,
    changed: watch::Sender<u64>,
}

/// What [`EngineQueue::join`] gives.
#[derive(Debug)]
pub enum Place {
    /// The engine was free: run now.
    Run(EnginePermit),
    /// Wait with this ticket.
    Wait(Ticket),
}

impl EngineQueue {
    /// A queue that lets `max_waiting` requests wait behind the running one.
    pub fn new(max_waiting: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            max_waiting,
            changed: watch::Sender::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a few integers that every holder leaves consistent: a panic elsewhere cannot corrupt it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Takes the engine if it is free and nobody waits, else a place at the back; `None` when the queue is full.
    pub fn join(self: &Arc<Self>) -> Option<Place> {
        let mut s = self.lock();
        if !s.running && s.waiting.is_empty() {
            s.running = true;
            return Some(Place::Run(EnginePermit(Arc::clone(self))));
        }
        if s.waiting.len() >= self.max_waiting {
            return None;
        }
        let id = s.next_ticket;
        s.next_ticket += 1;
        s.waiting.push_back(id);
        drop(s);
        self.bump();
        Some(Place::Wait(Ticket {
            queue: Arc::clone(self),
            id,
            done: false,
        }))
    }

    /// Requests waiting (not counting the running one).
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Whether a generation holds the engine.
    pub fn is_running(&self) -> bool {
        self.lock().running
    }
}

/// A place in the queue; dropping it leaves the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<EngineQueue>,
    id: u64,
    done: bool,
}

impl Ticket {
    /// 1-based position among the waiters (1 = next).
    pub fn position(&self) -> usize {
        let s = self.queue.lock();
        s.waiting
            .iter()
            .position(|&t| t == self.id)
            .map_or(0, |p| p + 1)
    }

    /// Takes the engine when this ticket is first in line and the engine is free.
    fn try_take(&mut self) -> Option<EnginePermit> {
        let mut s = self.queue.lock();
        if s.running || s.waiting.front() != Some(&self.id) {
            return None;
        }
        s.waiting.pop_front();
        s.running = true;
        drop(s);
        self.done = true;
        self.queue.bump();
        Some(EnginePermit(Arc::clone(&self.queue)))
    }

    /// Waits for the next change of the queue, then returns the permit if it is this ticket's turn, else its new
    /// position.
    pub async fn next(&mut self) -> Result<EnginePermit, usize> {
        let mut changes = self.queue.changed.subscribe();
        // Checked after subscribing: a change between the check and the wait is not missed.
        if let Some(permit) = self.try_take() {
            return Ok(permit);
        }
        // The sender lives in the queue this ticket holds: it cannot close.
        let _ = changes.changed().await;
        self.try_take().ok_or_else(|| self.position())
    }

    /// Waits for this ticket's turn.
    pub async fn wait(mut self) -> EnginePermit {
        loop {
            if let Ok(permit) = self.next().await {
                return permit;
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut s = self.queue.lock();
        s.waiting.retain(|&t| t != self.id);
        drop(s);
        self.queue.bump();
    }
}

/// Holding the engine; released on drop (the next waiter then takes it).
#[derive(Debug)]
pub struct EnginePermit(Arc<EngineQueue>);

impl Drop for EnginePermit {
    fn drop(&mut self) {
        self.0.lock().running = false;
        self.0.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn first_in_first_out_with_a_bound_and_leavers() {
        let q = EngineQueue::new(2);
        let Some(Place::Run(running)) = q.join() else {
            panic!("the engine is free")
        };
        let Some(Place::Wait(a)) = q.join() else {
            panic!("a waits")
        };
        let Some(Place::Wait(b)) = q.join() else {
            panic!("b waits")
        };
        assert!(q.join().is_none(), "two waiting: full");
        assert_eq!((a.position(), b.position()), (1, 2));
        assert_eq!(q.waiting(), 2);

        // b waits in the background; a leaves (its client went away): b is next.
        let b_turn = tokio::spawn(b.wait());
        drop(a);
        assert_eq!(q.waiting(), 1);
        assert!(!b_turn.is_finished());
        drop(running);
        let permit_b = tokio::time::timeout(std::time::Duration::from_secs(5), b_turn)
            .await
            .expect("b's turn comes")
            .expect("task");
        assert!(q.is_running());
        assert_eq!(q.waiting(), 0);
        // A newcomer waits behind b.
        let Some(Place::Wait(mut c)) = q.join() else {
            panic!("c waits")
        };
        assert_eq!(c.position(), 1);
        drop(permit_b);
        let permit_c = c.next().await.expect("c runs");
        drop(permit_c);
        assert!(!q.is_running());
        assert!(matches!(q.join(), Some(Place::Run(_))));
    }
}
