//! How work reaches the decode thread: each row source has an inbox of its own, and every
//! sender rings one [`Doorbell`] that an idle decode loop sleeps on, so the loop wakes for
//! whichever source has work without knowing which.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Rung by every sender of the decode loop's inboxes; an idle loop waits on it.
#[derive(Default)]
pub struct Doorbell {
    rung: Mutex<bool>,
    ring: Condvar,
}

impl Doorbell {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn rung(&self) -> MutexGuard<'_, bool> {
        // A sender that panicked while holding the flag left it a plain bool.
        self.rung.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the loop (or makes its next wait return at once).
    pub fn ring(&self) {
        *self.rung() = true;
        self.ring.notify_one();
    }

    /// Waits up to `timeout` for a ring (one since the last wait counts); whether it rang.
    pub fn wait(&self, timeout: Duration) -> bool {
        let rung = self.rung();
        let (mut rung, _) = self
            .ring
            .wait_timeout_while(rung, timeout, |r| !*r)
            .unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *rung)
    }
}

/// The decode thread has stopped: nothing more can be handed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// The sending side of a source's inbox: each send rings the doorbell.
pub struct Sender<T> {
    tx: mpsc::Sender<T>,
    bell: Arc<Doorbell>,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            tx: self.tx.clone(),
            bell: self.bell.clone(),
        }
    }
}

impl<T> Sender<T> {
    /// Hands `item` over; it comes back when the decode thread has stopped.
    pub fn send(&self, item: T) -> Result<(), T> {
        self.tx.send(item).map_err(|e| e.0)?;
        self.bell.ring();
        Ok(())
    }
}

/// A source's inbox: what its senders handed over, taken without waiting.
pub struct Inbox<T>(mpsc::Receiver<T>);

impl<T> Inbox<T> {
    pub fn drain(&self) -> mpsc::TryIter<'_, T> {
        self.0.try_iter()
    }
}

/// A new inbox whose sends ring `bell`.
pub fn inbox<T>(bell: &Arc<Doorbell>) -> (Sender<T>, Inbox<T>) {
    let (tx, rx) = mpsc::channel();
    let bell = bell.clone();
    (Sender { tx, bell }, Inbox(rx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_send_wakes_a_waiter_and_a_ring_before_the_wait_counts_once() {
        let bell = Doorbell::new();
        let (tx, rx) = inbox::<u32>(&bell);
        tx.send(1).expect("open");
        assert!(bell.wait(Duration::from_secs(5)), "rung before the wait");
        assert!(!bell.wait(Duration::from_millis(10)), "a ring counts once");
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(2).expect("open");
        });
        let t0 = Instant::now();
        assert!(bell.wait(Duration::from_secs(5)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        sender.join().expect("sender");
        assert_eq!(rx.drain().collect::<Vec<_>>(), [1, 2]);
        drop(rx);
        let (tx, rx) = inbox::<u32>(&bell);
        drop(rx);
        assert_eq!(tx.send(3), Err(3), "a closed inbox hands the item back");
    }
}
