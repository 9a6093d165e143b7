//! The decode loop driven by a source it was not written for: requests that arrive from
//! another thread, one the model refuses, a batch too small for all of them at once.

use super::inbox::{self, Inbox};
use super::{Decoder, Doorbell, Panicked, RowSource, Rows, Waiting};
use crate::model::draw::tests::params;
use crate::model::sampler::{Completion, Drawn, Request};
use crate::model::{Architecture, InferBackend, ModelConfig, ModelError, Policy};
use crate::weights::{ModelSlot, Versioned};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the test source saw.
#[derive(Default)]
struct Seen {
    /// Per request: its rows' completions, or why the model refused it.
    ended: BTreeMap<u64, Result<Vec<Completion>, String>>,
    drawn: Vec<Drawn>,
    /// The most rows decoding at once.
    peak: usize,
}

/// A test-only source: `n` watched rows of each prompt it receives; done once `expect`
/// requests have ended one way or another.
struct Scripted {
    inbox: Inbox<Vec<u32>>,
    queue: VecDeque<Vec<u32>>,
    n: usize,
    expect: usize,
    open: BTreeMap<u64, usize>,
    seen: Arc<Mutex<Seen>>,
}

impl Scripted {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().expect("not poisoned")
    }
}

impl RowSource for Scripted {
    fn receive(&mut self) {
        self.queue.extend(self.inbox.drain());
    }

    fn waiting(&self) -> Waiting {
        if self.queue.is_empty() {
            Waiting::Nothing
        } else {
            Waiting::Ready
        }
    }

    fn busy(&self) -> bool {
        !self.open.is_empty()
    }

    fn admit(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError> {
        while rows.fit(self.n) {
            let Some(prompt) = self.queue.pop_front() else {
                break;
            };
            let req = Request {
                id: rows.new_request(),
                prompt,
                n: self.n,
                params: params(1.0, 0, 1.0),
            };
            let admitted =
                rows.prefill(|g, model, v| g.admit_watched(model, v, &req, Default::default()));
            match admitted {
                Ok(Ok(())) => {
                    self.open.insert(req.id, self.n);
                    self.seen().ended.insert(req.id, Ok(Vec::new()));
                }
                Ok(Err(ModelError::Refused(r))) => {
                    self.seen().ended.insert(req.id, Err(r.reason.to_string()));
                }
                Ok(Err(e)) => return Err(e),
                Err(panic) => panic!("a prefill panicked: {panic}"),
            }
        }
        let active = rows.generator().active();
        let mut seen = self.seen();
        seen.peak = seen.peak.max(active);
        Ok(())
    }

    fn owns(&self, request: u64) -> bool {
        self.open.contains_key(&request)
    }

    fn drawn(&mut self, _rows: &mut Rows<'_>, drawn: Drawn) {
        self.seen().drawn.push(drawn);
    }

    fn finished(&mut self, _rows: &mut Rows<'_>, c: Completion) {
        let id = c.request_id;
        if let Some(Ok(done)) = self.seen().ended.get_mut(&id) {
            done.push(c);
        }
        if let Some(open) = self.open.get_mut(&id) {
            *open -= 1;
            if *open == 0 {
                self.open.remove(&id);
            }
        }
    }

    fn panicked(&mut self, request: u64, how: &Panicked<'_>) {
        panic!("request {request}'s pass panicked: {}", how.message);
    }

    fn closed(&self) -> bool {
        self.open.is_empty() && self.seen().ended.len() == self.expect
    }
}

#[test]
fn a_fourth_row_source_is_batched_woken_and_handed_its_own_rows() {
    let cfg = ModelConfig::tiny(Architecture::Llama, 12);
    let policy = Policy::<InferBackend>::random(&cfg, 3, &Default::default()).expect("model");
    let slot = ModelSlot::new(Versioned { version: 7, policy });
    let bell = Doorbell::new();
    let (tx, rx) = inbox::inbox::<Vec<u32>>(&bell);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let source = Scripted {
        inbox: rx,
        queue: VecDeque::new(),
        n: 2,
        expect: 4,
        open: BTreeMap::new(),
        seen: seen.clone(),
    };
    // A batch of 4 rows: two requests of 2 rows at a time.
    let decoder = Decoder::new("test", 4, slot, vec![Box::new(source)], bell);
    let handle = decoder
        .spawn(Arc::new(AtomicBool::new(false)))
        .expect("thread");
    // Sent from here once the loop has gone idle: the doorbell wakes it.
    std::thread::sleep(Duration::from_millis(50));
    for prompt in [vec![1, 2], vec![3], vec![2, 12], vec![4, 5, 6]] {
        tx.send(prompt).expect("the loop is running");
    }
    // The source says it is done once every request has ended: the loop stops.
    let stats = handle.join().expect("no panic").expect("no model error");
    let seen = seen.lock().expect("not poisoned");
    assert_eq!(seen.peak, 4, "the batch is filled and never overfilled");
    let ended: Vec<_> = seen.ended.values().collect();
    assert_eq!(ended.len(), 4);
    assert_eq!(
        ended[2].as_ref().err().map(String::as_str),
        Some("vocabulary"),
        "an id past the vocabulary is the source's to hear of"
    );
    for (id, done) in seen
        .ended
        .iter()
        .filter_map(|(id, e)| Some((id, e.as_ref().ok()?)))
    {
        assert_eq!(done.len(), 2, "request {id}: both rows");
        for c in done {
            assert_eq!(c.request_id, *id);
            assert_eq!(c.tokens.len(), 8);
            assert!(
                c.versions.iter().all(|run| run.version == 7),
                "{:?}",
                c.versions
            );
            let drawn: Vec<u32> = seen
                .drawn
                .iter()
                .filter(|d| d.request_id == *id && d.index == c.index)
                .map(|d| d.token)
                .collect();
            assert_eq!(drawn, c.tokens, "every token reported as drawn, in order");
        }
    }
    assert_eq!(
        stats.tokens,
        3 * 2 * 8,
        "three requests of 2 rows of 8 tokens"
    );
    assert!(stats.steps >= 8 && stats.idle_s > 0.0, "{stats:?}");
}
